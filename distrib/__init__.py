"""distrib: a data-parallel trainer for PyTorch; one code path from one CPU to many GPU nodes.

    from distrib import fit
    summary = fit(model, train_data, test_data, overrides={"train.epochs": 2})

`import distrib` imports nothing heavy: torch comes in with the first use of fit, Config or load_config."""

__version__ = "0.1.0"
__all__ = ["Config", "Preempted", "fit", "load_config"]

_LAZY = {"fit": "distrib.api", "Config": "distrib.config", "load_config": "distrib.config",
         "Preempted": "distrib.errors"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'distrib' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
