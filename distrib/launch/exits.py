"""How a launch ends when it does not simply finish: the stop signals' handlers (SIGTERM, SIGUSR1: preemption), and
the exit code and last line after a stop signal or a failed worker, which tell a job script whether to requeue."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Iterator, Sequence

from distrib.errors import EXIT_PREEMPTED, say
from distrib.launch.reporting import cause_of

# Signals that ask a run to stop for preemption: SLURM's --signal and scancel, Kubernetes and most schedulers.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def signal_exit_code(signum: int, codes: Sequence[int | None] = ()) -> int:
    """The exit code after signal signum reached the launcher, from the exit codes of this attempt's workers (from
    their lifelines; None: killed with it): EXIT_PREEMPTED for SIGTERM/SIGUSR1 when no worker had started (nothing
    is lost) or when the workers ended with EXIT_PREEMPTED (their checkpoint is committed), so the job script
    requeues; otherwise a worker's own failure code (e.g. EXIT_HUNG), or 128 + N as a shell reports signal N."""
    if signum in STOP_SIGNALS:
        if not codes or (all(c in (0, EXIT_PREEMPTED) for c in codes) and EXIT_PREEMPTED in codes):
            return EXIT_PREEMPTED
        if all(c == 0 for c in codes):
            return 0
    failed = [c for c in codes if c is not None and c > 0 and c != EXIT_PREEMPTED]
    return failed[0] if failed else 128 + signum


def stopped_line(signum: int, codes: Sequence[int | None], code: int) -> str:
    name = signal.Signals(signum).name
    if not codes:
        return f"distrib launch: stopped by {name} before any worker started; exit {code}" + (
            ": requeue the job and it starts (or resumes) there" if code == EXIT_PREEMPTED else "")
    ended = ", ".join("running (killed)" if c is None else f"killed by signal {-c}" if c < 0 else f"exit {c}"
                      for c in codes)
    verdict = ("every worker ended with 75 (checkpointed, or nothing to lose): requeue the job and it resumes there"
               if code == EXIT_PREEMPTED
               else "the workers had finished" if code == 0
               else "not every worker ended with 75, so this is no preemption exit")
    return f"distrib launch: stopped by {name}; the workers were stopped too ({ended}); {verdict}; exit {code}"


def _exit_before_start(signum, frame) -> None:
    """A stop signal before any worker or store exists: nothing to stop or lose, so the launcher ends at once. Not by
    raising: an exception raised inside an import (torch, numpy) can leave a module half-initialised and end the
    launcher with an ImportError instead."""
    code = signal_exit_code(signum)
    say(stopped_line(signum, [], code))
    os._exit(code)


@contextlib.contextmanager
def stop_handlers(raise_for=None) -> Iterator[None]:
    """SIGTERM and SIGUSR1 raise raise_for(signum) in the main thread while inside (without raise_for: end the
    launcher at once); the old handlers come back. torch's agent installs its own SIGTERM handler (raising
    SignalException) once it starts workers."""
    def raising(signum, frame):
        raise raise_for(signum)
    from distrib.launch.preempt import signal_handlers

    with signal_handlers(STOP_SIGNALS, raising if raise_for else _exit_before_start):
        yield


def exit_code(error) -> int:
    """The failing rank's exit code (reporting.cause_of), or 128 + N for the signal N that killed it (a worker killed
    by SIGTERM did not checkpoint: no preemption exit); EXIT_PREEMPTED when no rank failed, only preempted, so that
    the job script requeues."""
    cause = cause_of(error)
    if cause is None:
        return EXIT_PREEMPTED
    code = error.failures[cause].exitcode
    return code if code > 0 else 128 - code

