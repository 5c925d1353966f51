"""Preemption: during training a signal handler only sets a flag; the ranks agree on it at the next sync step (in
its small all-reduce), checkpoint and exit with EXIT_PREEMPTED, which job scripts answer with a requeue; before
training a signal ends the worker with EXIT_PREEMPTED at once."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Callable, Iterator

from distrib.errors import EXIT_PREEMPTED, Preempted, say
from distrib.launch_env import STOP_SIGNALS

__all__ = ["Preempted", "StopFlag", "exit_on_signals", "ignore_stop_signals", "parse_signals", "signal_handlers",
           "stop_on_signals"]


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
def signal_handlers(signals, handler) -> Iterator[None]:
    """`handler` for each of `signals` while inside; the old handlers come back after. Outside the main thread
    (Ray Train runs train_loop_per_worker in a thread of its actor) Python takes no handler: the signals then stay
    with the process's owner (Ray stops and restarts its workers itself), and none is set."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextlib.contextmanager
def stop_on_signals(signals: list[signal.Signals]) -> Iterator[StopFlag]:
    """Installs the flag-setting handler for the duration of training, then puts the old handlers back."""
    flag = StopFlag()
    with signal_handlers(signals, flag.set):
        yield flag


@contextlib.contextmanager
def exit_on_signals(signals: list[signal.Signals], announce: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """Outside the training steps (where stop_on_signals takes the signals over), a stop signal ends the worker with
    EXIT_PREEMPTED at once, as nothing since the last checkpoint can be lost there; with a line on stderr if
    announce() says so. Not by raising: the signal often lands inside an import (torch imports parts of numpy
    lazily), where C code may swallow the exception and leave a module half-initialised, and the worker went on and
    failed later with exit 1 (a RecursionError in numpy's __getattr__), or trained on."""
    def exit_early(signum, frame) -> None:
        try:
            if announce():
                say(f"distrib: stopped by {signal.Signals(signum).name} outside the training steps (starting up, or "
                    f"after the final checkpoint), so nothing was lost; exit code {EXIT_PREEMPTED}: requeue the job "
                    "and it starts (or resumes) there")
        finally:  # also when announce() or a reentrant write to stderr raised
            os._exit(EXIT_PREEMPTED)
    with signal_handlers(signals, exit_early):
        yield


def ignore_stop_signals(worker_id: int = 0) -> None:
    """The worker_init_fn of every DataLoader: its worker processes ignore the stop signals, which are the training
    process's (it checkpoints, or says which peer it lost, then ends its workers itself). Launchers signal a worker's
    whole process group (torch's agent, distrib's lifeline), and torch's DataLoader workers die of a SIGTERM their
    parent did not send, which made the training process raise "DataLoader worker (pid N) is killed by signal:
    Terminated" in whatever it was doing. Should the training process die first, its workers end within seconds
    (they watch their parent). SIGINT stays: the workers end quietly on it."""
    for signum in STOP_SIGNALS:
        if signum != signal.SIGINT:
            signal.signal(signum, signal.SIG_IGN)
