"""Checkpoint files: complete, atomic, verified, safely loaded; broken ones give a clear error or a fall-back."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distrib.checkpoint.format import (
    FORMAT,
    VERSION,
    checkpoint_path,
    digest,
    list_checkpoints,
    read_checkpoint,
    save_atomic,
)
from distrib.launch.rundir import LOCK_NAME
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO

CPU = torch.device("cpu")


def _write(directory: Path, step: int) -> Path:
    state = {"format": FORMAT, "version": VERSION, "progress": {"step": step}, "model": {"w": torch.arange(1000.0)}}
    state["checksum"] = digest(state)
    return save_atomic(state, checkpoint_path(directory, step))


@pytest.mark.timeout(900)
def test_sigkill_during_a_save_never_leaves_a_partial_file(tmp_path):
    path = tmp_path / "step_00000001.pt"
    for delay in (0.01, 0.05, 0.21):  # early in a save, mid-way, late (each a fresh process: torch imports)
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "helpers" / "save_loop.py"), str(path)],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert proc.stdout.readline().strip() == "1"  # one save completed; the next is under way
            time.sleep(delay)  # part-way into a later save
        finally:
            proc.kill()
            proc.wait(timeout=30)
        # The old complete file or the new complete one, never a torn one.
        state = read_checkpoint(path, CPU)
        assert torch.equal(state["model"]["w"], torch.full((4_000_000,), float(state["progress"]["step"])))
    assert list_checkpoints(tmp_path) == [path]


SMALL = ["data.name=synthetic", "data.synthetic_train_size=256", "data.synthetic_test_size=64", "run.progress=false",
         "train.global_batch_size=32", "train.schedule=constant", "train.warmup_steps=2", "train.eval_every_epochs=0",
         "dist.device=cpu"]


@pytest.mark.timeout(900)
def test_checkpoint_time_is_not_step_time(tmp_path, monkeypatch):
    """A virtual clock: each reading moves it 1 ms, and every save 100 s. Steps stay milliseconds long."""
    from distrib.checkpoint import policy
    from distrib.config import load_config
    from distrib.training import throughput
    from distrib.worker import run_training

    clock = [0.0]

    def perf_counter():
        clock[0] += 1e-3
        return clock[0]

    real_save = policy.Checkpoints.save

    def slow_save(self, step, **kwargs):
        clock[0] += 100.0
        return real_save(self, step, **kwargs)

    monkeypatch.setattr(throughput.time, "perf_counter", perf_counter)
    monkeypatch.setattr(policy.Checkpoints, "save", slow_save)
    summary = run_training(load_config(None, [*SMALL, f"run.dir={tmp_path}", "train.max_steps=12",
                                              "checkpoint.every_steps=2", "metrics.timing_skip_steps=0",
                                              "train.log_every=3"]))
    assert summary["timed_steps"] == 12 and summary["step_time_p95_s"] < 1.0, summary


@pytest.mark.timeout(900)
def test_ranks_that_do_not_share_checkpoint_dir_or_run_dir_are_told_so_on_every_rank(tmp_path):
    """Before, the ranks compared steps, and a checkpoint's name carries its step: an unshared folder passed. Node 1
    holds another file of the same step, node 2 none at all (its error reaches every rank: nobody waits on it). Then
    the same ranks take run.dir as a sharded run does: node 1 holds another run's folder (with its lock file), node 2
    none; every rank is refused before anything is written, and rank 0 removes the folders it made."""
    from tests.helpers.support import run as run_cmd

    _write(tmp_path / "node0" / "ck", 10)
    state = {"format": FORMAT, "version": VERSION, "progress": {"step": 10}, "model": {"w": torch.zeros(1000)}}
    state["checksum"] = digest(state)
    save_atomic(state, checkpoint_path(tmp_path / "node1" / "ck", 10))
    (tmp_path / "node2" / "ck").mkdir(parents=True)
    (tmp_path / "node1" / "run").mkdir()
    (tmp_path / "node1" / "run" / LOCK_NAME).write_text("host elsewhere, pid 1, since 2026-01-01T00:00:00+00:00\n")
    result = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                      str(REPO / "tests" / "helpers" / "probe_unshared.py"), str(tmp_path)], timeout=EVENT_S)
    assert result.returncode == 0, result
    outcomes = [(tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in range(3)]
    lines = [resumed for resumed, _ in outcomes]
    assert [line[:15] for line in lines] == ["rank 0 error ch", "rank 1 error ch", "rank 2 error ch"], result
    assert len({line[7:] for line in lines}) == 1  # one message, on every rank
    theirs = read_checkpoint(tmp_path / "node0" / "ck" / "step_00000010.pt", CPU)["checksum"]
    for text in ("the ranks did not load the same file", f"rank 0: {theirs[:16]}", f"rank 1: {state['checksum'][:16]}",
                 "rank 2: checkpoint ck/step_00000010.pt: no such file",
                 "checkpoint.dir must be one folder shared by every node"):
        assert text in lines[0], lines[0]
    run_dir = [taken for _, taken in outcomes]
    assert len({line[7:] for line in run_dir}) == 1 and run_dir[0].startswith("rank 0 error exit 2: run.dir = 'run'")
    for text in ("ranks 1, 2 (on ", ") do not see the folder rank 0 (on ", "must be one folder shared by every node",
                 "every rank writes its part of the run's weights", "--set run.dir="):
        assert text in run_dir[0], run_dir[0]
    assert not (tmp_path / "node0" / "run").exists() and not (tmp_path / "node2" / "run").exists()
    assert [p.name for p in (tmp_path / "node1" / "run").iterdir()] == [LOCK_NAME]  # another run's: untouched
