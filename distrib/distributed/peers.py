"""Which ranks are alive and where they are: a heartbeat through the rendezvous store, and the one line that names
the ranks a timed-out or broken collective waited for (their host, pid, last step, and whether they still beat)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

BEAT_INTERVAL_S = 1.0
SILENT_AFTER_S = 3 * BEAT_INTERVAL_S  # no new beat for this long: the rank is stopped or gone, not slow
MIN_BEAT_GAP_S = 0.01  # at most 100 beats a second per rank, however short the steps: the store serves every rank


@dataclass(frozen=True, slots=True)
class Beat:
    """What a rank last said about itself."""

    host: str
    pid: int
    where: str  # e.g. "after step 12", or "before training"
    count: int  # beats so far: unchanged across a wait means the process is stopped or gone

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, {self.where}"


class PeerWatch:
    """A daemon thread writes this rank's Beat to the store every BEAT_INTERVAL_S, and at once after each finished
    step (step_done), on a store connection of its own so it never waits behind the main thread; after a failed
    collective, diagnose() tells who did not arrive and why, once on_failure (the hang dump) has run."""

    def __init__(self, connect: Callable[[], dist.Store], rank: int, world_size: int, timeout_s: float,
                 on_failure: Callable[[str], None] | None = None):
        self.rank, self.world_size, self.timeout_s, self.on_failure = rank, world_size, timeout_s, on_failure
        self.where: Callable[[], str] = lambda: "before training"
        self._connect, self._store, self._lock = connect, None, threading.Lock()
        self._host, self._count = socket.gethostname(), 0
        self._stop, self._due = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="distrib-heartbeat", daemon=True)

    def start(self) -> "PeerWatch":
        self.beat()  # the first beat before training, so every rank's host and pid are known from the start
        self._thread.start()
        return self

    def step_done(self) -> None:
        """After each step, from the main thread: wakes the beat thread (no store call, no host sync here), so the last
        beat of a rank that stops names the step it last finished, not one from up to BEAT_INTERVAL_S before."""
        self._due.set()

    def stop(self) -> None:
        self._stop.set()
        self._due.set()
        self._thread.join(timeout=2 * BEAT_INTERVAL_S)

    def _store_(self) -> dist.Store:
        if self._store is None:
            self._store = self._connect()
        return self._store

    def beat(self) -> None:
        self._count += 1
        beat = Beat(self._host, os.getpid(), self.where(), self._count)
        with self._lock:
            self._store_().set(f"beat/{self.rank}", json.dumps([beat.host, beat.pid, beat.where, beat.count]))

    def _run(self) -> None:
        while True:
            self._due.wait(BEAT_INTERVAL_S)
            self._due.clear()  # before reading where(): a step finished while beating is beaten next time
            if self._stop.is_set():
                return
            try:
                self.beat()
            except Exception:  # the store is gone (its host ended): nothing left to tell anyone
                return
            if self._stop.wait(MIN_BEAT_GAP_S):
                return

    def _read(self, key: str) -> str | None:
        with self._lock:
            store = self._store_()
            return store.get(key).decode() if store.check([key]) else None

    def beats(self) -> dict[int, Beat]:
        found = {}
        for rank in range(self.world_size):
            text = self._read(f"beat/{rank}")
            if text is not None:
                found[rank] = Beat(*json.loads(text))
        return found

    def grace_s(self) -> float:
        """How long to watch the others after a failure: a few beats, longer for long timeouts (busy hosts)."""
        return max(3 * BEAT_INTERVAL_S, min(10.0, self.timeout_s / 4))

    def diagnose(self, failure: str) -> str:
        """Marks this rank as arrived at the failed collective, watches the others for grace_s(), and returns one
        line: the ranks that did not arrive (or stopped beating), each with host, pid, last step and state; "" when
        the store cannot tell (its host, the first node's launcher, is gone too). on_failure(failure) first: the
        launcher may stop this rank before the watch ends."""
        if self.on_failure is not None:
            self.on_failure(failure)
        try:
            return self._diagnose(failure)
        except Exception:  # the failure is reported without names rather than hidden behind a store error
            return ""

    def first_to_tell(self, failure: str) -> bool:
        """Whether this rank is the first of this attempt to claim saying `failure`'s line (the store's add is atomic
        across ranks), so the survivors of one lost rank name it once; True when the store cannot tell, as then no
        other rank can claim it either."""
        try:
            with self._lock:
                return self._store_().add(f"told/{failure}", 1) == 1
        except Exception:
            return True

    def _diagnose(self, failure: str) -> str:
        with self._lock:
            self._store_().set(f"arrived/{self.rank}", self.where())
        before, started = self.beats(), time.monotonic()
        everyone = set(range(self.world_size))
        while True:  # until the grace ends, or every rank is accounted for: arrived, or silent for SILENT_AFTER_S
            time.sleep(0.5)
            arrived = {rank for rank in everyone if self._read(f"arrived/{rank}") is not None}
            waited = time.monotonic() - started
            if arrived == everyone or waited >= self.grace_s():
                break
            if waited >= SILENT_AFTER_S and arrived | _silent(before, self.beats()) == everyone:
                break  # a killed rank is named in seconds, not after the whole grace of a busy host
        after = self.beats()
        silent = _silent(before, after)
        if failure == "lost":  # a connection broke: the lost ranks are those whose heartbeat stopped, less those
            # that arrived here too: they saw the same failure and said so, then ended (not lost: their line is theirs)
            missing = sorted(silent - arrived) or sorted(everyone - arrived)
        else:
            missing = sorted(set(range(self.world_size)) - arrived)
        return "; ".join(_describe(rank, after.get(rank), rank in silent) for rank in missing)


def _silent(before: dict[int, Beat], after: dict[int, Beat]) -> set[int]:
    """The ranks that beat before and not since."""
    return {rank for rank, beat in after.items() if before.get(rank) == beat}


def _describe(rank: int, beat: Beat | None, silent: bool) -> str:
    if beat is None:
        return f"rank {rank} (never sent a heartbeat: it did not start, or its host cannot reach the store)"
    state = ("no heartbeat since: stopped, killed, or its host is gone" if silent
             else "still beating: busy in its own code, or in a collective the others did not run")
    return f"rank {rank} ({beat.describe()}; {state})"
