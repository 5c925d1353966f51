"""A rank's heartbeat names the step it last finished: each step wakes the beat thread, so a rank that stops right
after is named at that step, not at one from up to a beat interval before (35 steps stale in a toy run)."""

import json
import time

import torch.distributed as dist

from distrib.distributed import peers
from distrib.distributed.peers import PeerWatch


def _beat_where(store, rank: int) -> str:
    return json.loads(store.get(f"beat/{rank}").decode())[2]


def test_a_finished_step_is_beaten_at_once_not_at_the_next_interval(monkeypatch):
    monkeypatch.setattr(peers, "BEAT_INTERVAL_S", 3600.0)  # only step_done() can cause a beat within the test
    store, progress = dist.HashStore(), {"step": 0}
    watch = PeerWatch(lambda: store, 1, 2, timeout_s=60.0)
    watch.where = lambda: f"after step {progress['step']}"
    watch.start()
    try:
        assert _beat_where(store, 1) == "after step 0"
        for step in (1, 2, 3):
            progress["step"] = step
            watch.step_done()
        deadline = time.monotonic() + 60  # generous: the beat thread may wait for a busy machine's scheduler
        while _beat_where(store, 1) != "after step 3" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _beat_where(store, 1) == "after step 3"
    finally:
        started = time.monotonic()
        watch.stop()
    assert time.monotonic() - started < 30, "stop() waits for the beat thread, which waits for the next beat"
