"""Checkpoint files: complete, atomic, verified, safely loaded; broken ones give a clear error or a fall-back."""

import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import REPO

from distrib.checkpoint.format import (
    FORMAT,
    VERSION,
    CheckpointError,
    _newest_good,
    checkpoint_path,
    digest,
    list_checkpoints,
    read_checkpoint,
    save_atomic,
)

CPU = torch.device("cpu")


def _write(directory: Path, step: int) -> Path:
    state = {"format": FORMAT, "version": VERSION, "progress": {"step": step}, "model": {"w": torch.arange(1000.0)}}
    state["checksum"] = digest(state)
    return save_atomic(state, checkpoint_path(directory, step))


def test_round_trip_and_newest_first(tmp_path):
    for step in (5, 100, 20):
        _write(tmp_path, step)
    (tmp_path / ".step_00000200.pt.123.tmp").write_bytes(b"half a file")  # a dead writer's leftover
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000100.pt", "step_00000020.pt", "step_00000005.pt"]
    state = read_checkpoint(tmp_path / "step_00000100.pt", CPU)
    assert state["progress"]["step"] == 100 and torch.equal(state["model"]["w"], torch.arange(1000.0))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: only the checksum can notice
    path.write_bytes(bytes(data))


def _empty(path):
    path.write_bytes(b"")


def _foreign(path):
    torch.save({"conv1.weight": torch.zeros(3)}, path)  # a plain state_dict, not ours


@pytest.mark.parametrize("damage, reason", [(_truncate, "unreadable"), (_flip, "checksum mismatch"),
                                            (_empty, "empty file"), (_foreign, "not a distrib checkpoint")])
def test_broken_checkpoints_name_the_file_and_the_reason(tmp_path, damage, reason):
    path = _write(tmp_path, 7)
    damage(path)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(path, CPU)
    assert str(path) in str(info.value) and reason in str(info.value)


def test_auto_resume_falls_back_past_broken_checkpoints(tmp_path):
    _write(tmp_path, 10)
    _flip(_write(tmp_path, 20))
    _truncate(_write(tmp_path, 30))
    said = []
    path, state = _newest_good(tmp_path, CPU, said.append)
    assert path.name == "step_00000010.pt" and state["progress"]["step"] == 10
    assert len(said) == 2 and "step_00000030.pt" in said[0] and "falling back" in said[0]


class _Payload:
    """A pickle that would create a file when loaded unsafely."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    target = tmp_path / "pwned"
    path = checkpoint_path(tmp_path, 1)
    torch.save({"format": FORMAT, "version": VERSION, "evil": _Payload(target)}, path)
    for why in ("unsafe: the weights-only unpickler refused it (Unsupported global", "unreadable"):
        with pytest.raises(CheckpointError) as info:
            read_checkpoint(path, CPU)
        message = str(info.value)  # whole, one line: the refusal and its reason, never torch's hint to retry unsafely
        assert why in message and "\n" not in message and "weights_only=False" not in message, message
        with open(path, "wb") as f:  # a bare pickle, not even a zip archive: refused before any global is read
            pickle.dump(_Payload(target), f)
    assert not target.exists()
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match="unreadable"):
        read_checkpoint(path, CPU)


@pytest.mark.timeout(120)
def test_sigkill_during_a_save_never_leaves_a_partial_file(tmp_path):
    path = tmp_path / "step_00000001.pt"
    for delay in (0.01, 0.03, 0.05, 0.08, 0.13, 0.21):
        proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "save_loop.py"), str(path)],
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


@pytest.mark.timeout(120)
def test_checkpoint_time_is_not_step_time(tmp_path, monkeypatch):
    """A virtual clock: each reading moves it 1 ms, and every save 100 s. Steps stay milliseconds long."""
    from distrib.checkpoint import format as checkpoint
    from distrib.config import load_config
    from distrib.training import throughput
    from distrib.worker import run_training

    clock = [0.0]

    def perf_counter():
        clock[0] += 1e-3
        return clock[0]

    real_save = checkpoint.Checkpointer.save

    def slow_save(self, step):
        clock[0] += 100.0
        return real_save(self, step)

    monkeypatch.setattr(throughput.time, "perf_counter", perf_counter)
    monkeypatch.setattr(checkpoint.Checkpointer, "save", slow_save)
    summary = run_training(load_config(None, [*SMALL, f"run.dir={tmp_path}", "train.max_steps=12",
                                              "checkpoint.every_steps=2", "metrics.timing_skip_steps=0",
                                              "train.log_every=3"]))
    assert summary["timed_steps"] == 12 and summary["step_time_p95_s"] < 1.0, summary


@pytest.mark.timeout(120)
def test_a_preempted_run_closes_its_recorder(tmp_path, monkeypatch):
    """The CLI ends with os._exit, which skips finalisers: the recorder (metrics.jsonl, TensorBoard's writer and its
    queue) is closed on the way out of a run that stops early."""
    import os
    import signal

    from distrib.config import load_config
    from distrib.launch.preempt import Preempted
    from distrib.metrics import Recorder
    from distrib.training.trainer import Trainer
    from distrib.worker import run_training

    real_step, real_close, closed = Trainer.step, Recorder.close, []

    def step(self, micro_batches):
        if self.state.progress.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler only sets its flag
        return real_step(self, micro_batches)

    def close(self, status="finished"):
        closed.append((status, [logger.name for logger in self._trackers]))
        real_close(self, status)

    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(Recorder, "close", close)
    with pytest.raises(Preempted, match="preempted at step 2"):
        run_training(load_config(None, [*SMALL, f"run.dir={tmp_path}", "train.max_steps=50", "train.log_every=2",
                               "metrics.tensorboard=true"]))
    assert closed == [("preempted", ["tensorboard"])]


@pytest.mark.timeout(180)
def test_ranks_that_do_not_share_checkpoint_dir_are_told_so_on_every_rank(tmp_path):
    """Before, the ranks compared steps, and a checkpoint's name carries its step: an unshared folder passed. Node 1
    holds another file of the same step, node 2 none at all (its error reaches every rank: nobody waits on it)."""
    from support import run as run_cmd

    _write(tmp_path / "node0" / "ck", 10)
    state = {"format": FORMAT, "version": VERSION, "progress": {"step": 10}, "model": {"w": torch.zeros(1000)}}
    state["checksum"] = digest(state)
    save_atomic(state, checkpoint_path(tmp_path / "node1" / "ck", 10))
    (tmp_path / "node2" / "ck").mkdir(parents=True)
    result = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                      str(REPO / "tests" / "probe_unshared.py"), str(tmp_path)], timeout=150)
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert [line[:15] for line in lines] == ["rank 0 error ch", "rank 1 error ch", "rank 2 error ch"], result
    assert len({line[7:] for line in lines}) == 1  # one message, on every rank
    theirs = read_checkpoint(tmp_path / "node0" / "ck" / "step_00000010.pt", CPU)["checksum"]
    for text in ("the ranks did not load the same file", f"rank 0: {theirs[:16]}", f"rank 1: {state['checksum'][:16]}",
                 "rank 2: checkpoint ck/step_00000010.pt: no such file",
                 "checkpoint.dir must be one folder shared by every node"):
        assert text in lines[0], lines[0]
