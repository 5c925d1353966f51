"""User code named in the config as `package.module:function` (model.factory, train.loss, data.factory): imported
and called here, so that any failure in it becomes one line naming the config key, the value and the fix."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from distrib.errors import UserError


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def import_object(key: str, spec: str) -> Callable:
    """The callable that `spec` names; `key` (e.g. 'model.factory') is the config key it came from."""
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{key} = {spec!r}: cannot import {module_name!r} ({e}); "
                        "check the module path and that its package is on PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - the user's module raised while being imported
        raise UserError(f"{key} = {spec!r}: importing {module_name!r} raised {first_line(e)}; "
                        "fix that module (run `python -c 'import " + module_name + "'` to see the traceback)") from e
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UserError(f"{key} = {spec!r}: {module_name!r} has no {attr!r}; name a function defined there")
    if not callable(obj):
        raise UserError(f"{key} = {spec!r}: {attr!r} is not callable; name a function")
    return obj


def accepted(function: Callable, offered: dict[str, Any]) -> dict[str, Any]:
    """The entries of `offered` that `function` declares by name, as the docs promise: a `**kwargs` catches none
    of them (it gets model.kwargs alone), nor does a positional-only parameter."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return {}
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: value for name, value in offered.items() if name in params and params[name].kind in by_name}


def call_factory(key: str, spec: str, function: Callable, kwargs: dict[str, Any]) -> Any:
    """function(**kwargs); an exception inside it becomes one line naming the key (the traceback stays chained)."""
    try:
        return function(**kwargs)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory raised
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UserError(f"{key} = {spec!r}: calling it with ({given}) raised {first_line(e)}; "
                        "fix the factory or its kwargs") from e
