"""Preemption: a signal handler that only sets a flag; the ranks agree on it at a step boundary (inside the
per-step all-reduce), then checkpoint and exit with EXIT_PREEMPTED, which job scripts answer with a requeue."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class Preempted(Exception):
    """Raised on every rank at the step boundary where the ranks agreed to stop; the checkpoint is on disk."""

    def __init__(self, step: int, path):
        super().__init__(f"preempted at step {step}; checkpoint {path}")
        self.step, self.path = step, path


class StopFlag:
    """Set from a signal handler (no I/O, no collectives there: neither is safe inside a handler)."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""

    def set(self, signum, frame=None) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name


def parse_signals(text: str) -> list[signal.Signals]:
    """'SIGTERM,usr1' -> signals (config validation already refused names that are not signals)."""
    names = filter(None, (part.strip().upper() for part in text.split(",")))
    return [signal.Signals[name if name.startswith("SIG") else f"SIG{name}"] for name in names]


@contextlib.contextmanager
def stop_on_signals(signals: list[signal.Signals]) -> Iterator[StopFlag]:
    """Installs the flag-setting handler for the duration of training, then puts the old handlers back."""
    flag = StopFlag()
    previous = {s: signal.signal(s, flag.set) for s in signals}
    try:
        yield flag
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
