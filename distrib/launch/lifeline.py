"""Workers die with their launcher, and the launcher learns how each worker ended: Linux's parent-death signal, and
the small parent process that `distrib launch` puts between its elastic agent and each worker (no torch import).

    python -m distrib.launch.lifeline --parent PID --status DIR COMMAND [ARGS ...]

runs COMMAND as a child that is SIGKILLed when this process dies, which is SIGKILLed when PID (the launcher) dies;
passes stop signals on when the child is ready for them (see Relay); writes the child's exit code to DIR; and ends
as the child did (same code or signal).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from distrib.errors import EXIT_PREEMPTED
from distrib.launch_env import GROUP_VAR, STOP_SIGNALS, die_with_parent


def tied_to_parent(parent_pid: int, target: Callable, *args) -> None:
    """target(*args) in a helper process of a worker that multiprocessing started (spawn) with the STOP_SIGNALS
    blocked: SIGKILLed when parent_pid ends, deaf to the stop signals (a launcher or a scheduler signals the whole
    process group, and the worker decides: a preempted one waits for the write in flight), quiet below warnings.
    The entry point of the checkpoint process (distrib.checkpoint.process), whose torch code logs each save."""
    die_with_parent(parent_pid)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # one sent while it started is dropped now
    logging.disable(logging.INFO)
    target(*args)


@dataclass(frozen=True, slots=True)
class Status:
    """How one worker of the latest attempt stands: its lifeline's pid (the one torch's agent reports), the worker's
    own pid, and its exit code (negative: killed by that signal; None: running, or killed with its lifeline); its
    rank and local rank (None where torch's agent gave none), and when it ended (time.time_ns(); None: running)."""

    pid: int
    worker_pid: int
    code: int | None
    rank: int | None = None
    local_rank: int | None = None
    ended_ns: int | None = None


def write_status(status_dir: Path, attempt: str, status: Status) -> None:
    """DIR/ATTEMPT.PID, written to a temp name and renamed, so the launcher never reads half a file."""
    path = status_dir / f"{attempt}.{status.pid}"
    temp = path.with_name(f"{path.name}.tmp")  # per worker: the lifelines of one attempt write at the same time
    temp.write_text(json.dumps({"worker_pid": status.worker_pid, "code": status.code, "rank": status.rank,
                                "local_rank": status.local_rank, "ended_ns": status.ended_ns}))
    os.replace(temp, path)


def read_statuses(status_dir: Path) -> list[Status]:
    """The latest attempt's workers; an empty list when no worker was ever started."""
    return read_attempt(status_dir)[1]


def read_attempt(status_dir: Path) -> tuple[int, list[Status]]:
    """The latest attempt's number (TORCHELASTIC_RESTART_COUNT: 0 for the first) and its workers; (0, []) when no
    worker was ever started."""
    by_attempt: dict[int, list[Status]] = {}
    for path in Path(status_dir).glob("*.*"):
        attempt, _, pid = path.name.partition(".")
        if attempt.isdigit() and pid.isdigit():
            try:
                saved = json.loads(path.read_text())
                status = Status(int(pid), saved["worker_pid"], saved["code"], saved.get("rank"),
                                saved.get("local_rank"), saved.get("ended_ns"))
            except (OSError, ValueError, KeyError):
                status = Status(int(pid), int(pid), None)
            by_attempt.setdefault(int(attempt), []).append(status)
    return (max(by_attempt), by_attempt[max(by_attempt)]) if by_attempt else (0, [])


def catches(pid: int, signum: int) -> bool:
    """Whether process pid has a handler for signum (SigCgt in /proc/PID/status): its own code has started."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class Relay:
    """Passes stop signals on to the worker (in a process group of its own, so that only this relay decides when):
    at once if the worker handles the signal, or has run for READY_S; else once it handles it. A worker that is
    still starting its interpreter would otherwise die of a SIGTERM its trainer turns into a clean preemption exit a
    moment later. A stopped worker (SIGSTOP, a debugger) is continued, or it would act only after the agent's grace
    period and SIGKILL. doomed() true: the stop is SIGKILL, at once (see doomed_by_a_lost_peer)."""

    READY_S = 10.0

    def __init__(self, doomed: Callable[[], bool] = lambda: False):
        self.child: subprocess.Popen | None = None
        self.started_at = 0.0
        self.pending: list[int] = []
        self.doomed = doomed

    def __call__(self, signum, frame) -> None:
        self.pending.append(signum)
        self.relay()

    def start(self, child: subprocess.Popen) -> None:
        self.child, self.started_at = child, time.monotonic()
        self.relay()

    def relay(self) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            return
        ready = time.monotonic() - self.started_at >= self.READY_S
        doomed = bool(self.pending) and self.doomed()  # reads the statuses only when a signal waits
        for signum in list(self.pending):
            if doomed or ready or catches(child.pid, signum):
                try:
                    self.pending.remove(signum)
                except ValueError:  # relayed meanwhile by the signal handler, which calls this too
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL if doomed else signum)
                    os.killpg(child.pid, signal.SIGCONT)

    def wait(self) -> int:
        while True:  # with a timeout: a signal that came while the child was not ready is relayed from here
            try:
                return self.child.wait(timeout=0.1 if self.pending else 1.0)
            except subprocess.TimeoutExpired:
                self.relay()


def child_setup(lifeline_pid: int):
    """A child's setup between fork and exec: a process group of its own (a terminal's Ctrl-C reaches its parent
    alone, which passes it on) and a SIGKILL when lifeline_pid dies."""
    def setup() -> None:
        os.setpgid(0, 0)
        die_with_parent(lifeline_pid)
    return setup


def lost_a_peer(status_dir: Path) -> bool:
    """Whether a worker of this attempt failed (ended with neither 0 nor a preemption's code)."""
    return any(status.code not in (None, 0, EXIT_PREEMPTED) for status in read_statuses(status_dir))


def doomed_by_a_lost_peer(status_dir: Path) -> Callable[[], bool]:
    """Relay's doomed for this worker: inside a fault-tolerant replica group, lost_a_peer. A stop signal then comes
    from the launcher rebuilding the group, which heals from a live group: the worker can finish neither its step nor
    a checkpoint without the lost rank, and torchft's commit, which waits for that rank, would hold it, and the quorum
    of every other group, for the agent's 30 s of grace. Decided here, once, not in the signal handler, where an
    import could meet itself half done."""
    if not os.environ.get(GROUP_VAR):
        return lambda: False
    return lambda: lost_a_peer(status_dir)


def supervise(parent_pid: int, status_dir: Path, command: Sequence[str]) -> int:
    """Runs command under this lifeline; returns its exit code (negative: the signal that ended it)."""
    die_with_parent(parent_pid)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # set by the elastic agent for each attempt
    # The worker's ranks, as the agent set them for it, only to be written in the status: the launcher's line about
    # a restart names the rank that died (the worker itself reads them in runtime.read_launch_env).
    ranks = [int(os.environ[key]) if os.environ.get(key, "").isdigit() else None for key in ("RANK", "LOCAL_RANK")]
    relay = Relay(doomed_by_a_lost_peer(status_dir))
    for signum in STOP_SIGNALS:  # before the child exists: a stop request must never end this process alone
        signal.signal(signum, relay)
    child = subprocess.Popen(list(command), preexec_fn=child_setup(os.getpid()))
    relay.start(child)
    write_status(status_dir, attempt, Status(os.getpid(), child.pid, None, *ranks))
    code = relay.wait()
    write_status(status_dir, attempt, Status(os.getpid(), child.pid, code, *ranks, time.time_ns()))
    return code


def end_like(code: int) -> None:
    """Ends this process as the child ended, so the agent reports the child's code or signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def main(argv: Sequence[str]) -> None:
    if len(argv) < 5 or argv[0] != "--parent" or argv[2] != "--status":
        sys.stderr.write("usage: python -m distrib.launch.lifeline --parent PID --status DIR COMMAND [ARGS ...]\n")
        os._exit(2)
    end_like(supervise(int(argv[1]), Path(argv[3]), argv[4:]))


if __name__ == "__main__":
    main(sys.argv[1:])
