"""Hang dumps: torch's flight recorder (the last collectives of every process group, with their sequence numbers)
dumped by each rank into run.dir/hang/ when a collective outwaits dist.timeout_s (the launcher compares them:
distrib.launch.hang_traces).

    run.dir/hang/rank_N.trace   a rank's dump: torch's pickle, with a "distrib" entry (or rank_N, without: written
                                by torch's own watchdog where the backend has one, see runtime.recorder_env)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from distrib.errors import EXIT_HUNG
from distrib.launch.hang_traces import STOPPED_AFTER_S
from distrib.torch_private import dump_fr_trace

BUFFER_ENTRIES = 2000  # collectives the flight recorder keeps per process (torch's own default when it is on)
BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"  # read as a process group opens
TICK_S = 1.0
DUMP_KEY = "dump"  # in the store: set by the first rank that dumps; every other rank's watch dumps when it sees it


class HangWatch:
    """A daemon thread of one rank: every TICK_S it asks whether a collective of this rank has been in flight for
    longer than timeout_s, or whether another rank dumped (DUMP_KEY in the store, on a connection of its own); then
    this rank's trace goes to directory/rank_N.trace, once. failed() does the same from a failed collective's
    handler. dumps=False where torch's own watchdog dumps (runtime.recorder_env): then only the note is written.
    note: a file of the launcher's in which the folder of the traces is written, so that it compares them once
    the run ended."""

    def __init__(self, connect: Callable[[], dist.Store], rank: int, timeout_s: float, directory: Path,
                 dumps: bool = True, note: Path | None = None):
        self.rank, self.timeout_s, self.directory, self.note = rank, timeout_s, Path(directory), note
        self.dumps = dumps
        self._connect, self._store, self._lock = connect, None, threading.Lock()
        self._in_flight: dict[str, tuple[int, float]] = {}  # group -> (sequence number, first seen in flight)
        self._last_tick, self._stopped_s, self.dumped = time.monotonic(), 0.0, False
        self._last_tick_ns, self._stopped_since_ns = time.time_ns(), 0  # wall clock, as the recorder's entries
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distrib-hang-watch", daemon=True)

    def start(self) -> "HangWatch":
        if not self.dumps:  # torch's own dump opens its file in this folder and does not make it
            with contextlib.suppress(OSError):
                self.directory.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * TICK_S)

    def _run(self) -> None:
        while not self._stop.wait(TICK_S) and not self.dumped:
            now = time.monotonic()
            self._note_gap(now)
            self._last_tick, self._last_tick_ns = now, time.time_ns()
            try:
                if self._outwaited(now):
                    self.dump("timeout")
                elif self._asked():
                    self.dump("asked")
            except Exception:  # the store is gone (the launcher ended): nothing left to tell anyone
                return

    def _outwaited(self, now: float) -> bool:
        """Whether one process group's oldest collective in flight is the same one as timeout_s ago."""
        status = pickle.loads(dump_fr_trace(includeCollectives=False))["pg_status"]
        for group, state in status.items():
            if state["last_enqueued_collective"] <= state["last_completed_collective"]:
                self._in_flight.pop(group, None)
                continue
            seq = state["last_completed_collective"] + 1
            if self._in_flight.get(group, (None,))[0] != seq:
                self._in_flight[group] = (seq, now)
            elif now - self._in_flight[group][1] > self.timeout_s:
                return True
        return False

    def _note_gap(self, now: float) -> None:
        """The longest time this thread did not run past its tick (the process stopped), and by when (wall clock)
        that stop had begun: its last tick before it, plus a tick. Entries of this rank's recorder created after
        that were created once it ran again."""
        gap = now - self._last_tick - TICK_S
        if gap > self._stopped_s:
            self._stopped_s, self._stopped_since_ns = gap, self._last_tick_ns + int(TICK_S * 1e9)

    def _asked(self) -> bool:
        with self._lock:
            if self._store is None:
                self._store = self._connect()
            return self._store.check([DUMP_KEY])

    def failed(self, failure: str) -> None:
        """From a failed collective's handler (PeerWatch.diagnose): a timeout dumps; a lost peer ("lost") only once
        another rank dumped (a hang, which this rank saw end as the others gave up), not for a peer that died."""
        with contextlib.suppress(Exception):  # the store is gone: no rank dumped that this one could hear of
            if failure == "timeout" or self._asked():
                self.dump(failure)

    def dump(self, reason: str) -> None:
        """This rank's trace into the folder (once), the others asked to dump theirs, the launcher told where.
        reason: "timeout" (a collective outwaited dist.timeout_s), "lost" (a peer's connection broke), "asked".
        A rank that was stopped (SIGSTOP, a debugger) while another rank dumped before it (the others gave up on
        it) ends here, once dumped: see _end_stopped."""
        with self._lock:
            if self.dumped:
                return
            self.dumped = True
            self._note_gap(time.monotonic())
            stopped, gave_up = self._stopped_s >= STOPPED_AFTER_S, reason == "asked"
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                if self.dumps:
                    _write_trace(self.directory / f"rank_{self.rank}.trace", self.rank, reason, self._stopped_s,
                                 self._stopped_since_ns if stopped else None)
                if self.note is not None:
                    _write_atomic(self.note, str(self.directory).encode())
                if self._store is None:
                    self._store = self._connect()
                gave_up = gave_up or self._store.check([DUMP_KEY])  # another rank dumped first: the others gave up
                self._store.set(DUMP_KEY, str(self.rank))
            except Exception:  # noqa: BLE001 - a dump must never hide the failure it documents
                pass
        if stopped and gave_up:
            self._end_stopped()

    def _end_stopped(self) -> None:
        """Ends this process with EXIT_HUNG and one line. It did not run for longer than its peers could wait, and
        one of them dumped, so they gave up on it: run on, it would enter the collective they left and wait in it,
        up to dist.timeout_s if a peer's connection outlives it, then blame the peers it stopped for. os._exit: it
        runs in the watch thread too, while the main thread may be waiting in that collective."""
        sys.stderr.write(f"distrib: error: rank {self.rank} did not run for {self._stopped_s:.1f} s (stopped: "
                         "SIGSTOP, a debugger, or a frozen host) while the other ranks waited for it in a collective; "
                         f"they gave up on it, so it ends too (every rank's trace: {self.directory})\n")
        sys.stderr.flush()
        os._exit(EXIT_HUNG)


def _write_trace(path: Path, rank: int, reason: str, stopped_s: float, stopped_since_ns: int | None) -> None:
    """torch's dump without the collectives' stacks (symbolizing 2,000 of them takes seconds, which a stopped rank
    may not have before the launcher kills it), and, from the watch thread, the main thread's stack: where a rank
    that did not enter the others' collective is."""
    trace = pickle.loads(dump_fr_trace(includeStackTraces=False))
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident) if threading.current_thread() is not main else None
    stack = [(f.filename, f.lineno, f.name) for f in traceback.extract_stack(frame)[-8:]] if frame else []
    trace["distrib"] = {"rank": rank, "dumped_ns": time.time_ns(), "reason": reason,
                        "stopped_s": round(stopped_s, 1), "stopped_since_ns": stopped_since_ns, "main_stack": stack}
    _write_atomic(path, pickle.dumps(trace))


def _write_atomic(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_bytes(data)
    os.replace(temp, path)
