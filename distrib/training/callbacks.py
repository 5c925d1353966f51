"""Callbacks: the user's objects with any of four hooks, which the Trainer calls on every rank in the same order
(`fit(..., callbacks=[...])`, or `train.callbacks = ["package.module:Class"]`); a hook that raises is one line."""

from __future__ import annotations

import difflib
from typing import Any, Protocol, Sequence

import torch
import torch.nn as nn

from distrib.errors import UserError
from distrib.factory import first_line, import_object

HOOKS = ("on_train_start", "on_step_end", "on_evaluate", "on_train_end")
# The Hugging Face Trainer's and Lightning's names for the same moments, for the hint in the one-line error.
OTHER_NAMES = {"on_train_begin": "on_train_start", "on_fit_start": "on_train_start",
               "on_train_batch_end": "on_step_end", "on_validation_end": "on_evaluate",
               "on_validation_epoch_end": "on_evaluate", "on_fit_end": "on_train_end"}


class Callback(Protocol):
    """Any of these methods; the others may be left out. Every rank calls them, in the order of the list.

    on_train_start(model): once, before the first step (after a resume's checkpoint is loaded), with the unwrapped
        module in train mode. Modes set here stay: evaluation restores each module's own mode, not model.train().
    on_step_end(step, loss): after each optimizer step's log line and checkpoint; loss is a 0-dim tensor on the
        device, the global batch's mean on sync steps (log steps among them), this rank's part on the others
        (.item() waits for the device).
    on_evaluate(step, metrics): after each evaluation, with its exact metrics (as in metrics.jsonl).
    on_train_end(summary): once, after summary.json is written (not after a failure or a preemption)."""

    def on_train_start(self, model: nn.Module) -> None: ...

    def on_step_end(self, step: int, loss: torch.Tensor) -> None: ...

    def on_evaluate(self, step: int, metrics: dict) -> None: ...

    def on_train_end(self, summary: dict) -> None: ...


class Callbacks:
    """The run's callbacks; `callbacks.on_step_end(step, loss)` calls that hook of each one that has it, in order."""

    def __init__(self, callbacks: Sequence[Any] = ()):
        self.callbacks = tuple(callbacks)
        for index, callback in enumerate(self.callbacks):
            _check(callback, f"callbacks[{index}]")

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def _call(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception as e:  # noqa: BLE001 - the user's hook: one line naming it, its traceback chained
                name = f"{type(callback).__name__}.{hook}"
                raise UserError(f"callback {name} raised {first_line(e)}; fix the callback") from e

    def on_train_start(self, model: nn.Module) -> None:
        self._call("on_train_start", model)

    def on_step_end(self, step: int, loss: torch.Tensor) -> None:
        self._call("on_step_end", step, loss)

    def on_evaluate(self, step: int, metrics: dict) -> None:
        self._call("on_evaluate", step, dict(metrics))  # a copy: the summary keeps the metrics as measured

    def on_train_end(self, summary: dict) -> None:
        self._call("on_train_end", dict(summary))


def _check(callback: Any, where: str) -> None:
    """A callback has at least one hook; a class given for an instance, or hooks under other names, is one line."""
    if isinstance(callback, type):
        raise UserError(f"{where}: the class {callback.__name__}, not an instance; fix: give {callback.__name__}()")
    if any(callable(getattr(callback, hook, None)) for hook in HOOKS):
        return
    others = [name for name in dir(callback) if name.startswith("on_") and callable(getattr(callback, name))]
    guesses = {name: [OTHER_NAMES[name]] if name in OTHER_NAMES else difflib.get_close_matches(name, HOOKS, n=1)
               for name in others}
    hint = "; ".join(f"{name}: did you mean {guess[0]}?" for name, guess in guesses.items() if guess)
    raise UserError(f"{where}: a {type(callback).__name__} has none of the hooks {', '.join(HOOKS)}"
                    + (f" ({hint})" if hint else "") + "; fix: define at least one of them")


def from_config(specs: Sequence[str]) -> list[Any]:
    """train.callbacks: each `package.module:Class` (or a function returning a callback), called with no arguments."""
    made = []
    for index, spec in enumerate(specs):
        key = f"train.callbacks[{index}]"
        factory = import_object(key, spec)
        try:
            callback = factory()
        except Exception as e:  # noqa: BLE001 - the user's constructor raised
            raise UserError(f"{key} = {spec!r}: calling it with no arguments raised {first_line(e)}; "
                            "fix the class (it gets no arguments)") from e
        _check(callback, f"{key} = {spec!r}")
        made.append(callback)
    return made
