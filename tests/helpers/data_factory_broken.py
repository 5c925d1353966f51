"""A data factory module that fails at import (data.factory = tests.helpers.data_factory_broken:build)."""

raise RuntimeError("this module needs a GPU driver")


def build():  # pragma: no cover - never reached
    return None
