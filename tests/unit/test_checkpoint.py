"""Checkpoint files: complete, atomic, verified, safely loaded; broken ones give a clear error or a fall-back."""

import pickle
from pathlib import Path

import pytest
import torch

from distrib.checkpoint.format import (
    FORMAT,
    VERSION,
    CheckpointError,
    checkpoint_path,
    digest,
    list_checkpoints,
    read_checkpoint,
    save_atomic,
)
from distrib.checkpoint.resume import _newest_good

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


SMALL = ["data.name=synthetic", "data.synthetic_train_size=256", "data.synthetic_test_size=64", "run.progress=false",
         "train.global_batch_size=32", "train.schedule=constant", "train.warmup_steps=2", "train.eval_every_epochs=0",
         "dist.device=cpu"]


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


def test_a_re_saved_checkpoint_directory_is_exchanged_never_missing(tmp_path):
    from distrib.checkpoint.shard_dir import _swap

    final, tmp = tmp_path / "step_00000004", tmp_path / ".step_00000004.tmp"
    final.mkdir()
    (final / "old").write_text("old")
    tmp.mkdir()
    (tmp / "new").write_text("new")
    _swap(tmp, final)
    assert [p.name for p in final.iterdir()] == ["new"] and not tmp.exists()


def test_only_temporary_files_that_no_live_writer_holds_are_removed(tmp_path):
    import os

    from distrib.checkpoint.folder import remove_dead_temps
    from distrib.checkpoint.format import hold
    from distrib.checkpoint.shard_dir import WRITER

    _write(tmp_path, 2)
    (tmp_path / ".step_00000004.pt.0123456789ab.4242.tmp").write_bytes(b"half")  # its writer was killed
    (tmp_path / ".step_00000006.tmp").mkdir()  # a sharded one whose rank 0 died
    (tmp_path / ".step_00000006.tmp" / WRITER).write_bytes(b"")
    fd = hold(tmp_path / ".step_00000008.pt.feedfeedfeed.1.tmp")  # a live writer
    try:
        removed = remove_dead_temps(tmp_path)
        assert removed == [".step_00000004.pt.0123456789ab.4242.tmp", ".step_00000006.tmp"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [".step_00000008.pt.feedfeedfeed.1.tmp",
                                                             "step_00000002.pt"]
    finally:
        os.close(fd)
    assert remove_dead_temps(tmp_path) == [".step_00000008.pt.feedfeedfeed.1.tmp"]  # once its writer let go


def _write_of_run(directory: Path, name: str, step: int, run_id: str) -> Path:
    state = {"format": FORMAT, "version": VERSION, "run_id": run_id, "progress": {"step": step}}
    state["checksum"] = digest(state)
    return save_atomic(state, directory / f"{name}.pt")


def test_names_carry_the_run_id_only_beside_another_runs_and_old_names_still_resume(tmp_path):
    """A folder of the old names (step_N.pt, from before names could carry run ids) resumes as it is; a run that
    starts beside another run's checkpoints (checkpoint.foreign = keep) names its own step_N-RUNID, so no save of
    either ever lands on the other's name; each run prunes only its own."""
    from distrib.checkpoint.folder import listing, write_owner
    from distrib.checkpoint.format import checkpoint_name
    from distrib.checkpoint.resume import decide

    said = []
    old = [_write_of_run(tmp_path, f"step_{step:08d}", step, "aaaaaaaaaaaa") for step in (4, 8)]
    write_owner(tmp_path, "aaaaaaaaaaaa")
    path, state, run_id, owned, tagged = decide("auto", "refuse", tmp_path, CPU, said.append)
    assert (path, run_id, owned, tagged) == (old[1], "aaaaaaaaaaaa", old, False) and state["progress"]["step"] == 8

    path, state, new_id, owned, tagged = decide("never", "keep", tmp_path, CPU, said.append)
    assert path is None and state is None and new_id != run_id and owned == [] and tagged
    name = checkpoint_name("step", 4, new_id)
    assert name == f"step_00000004-{new_id}"
    new = _write_of_run(tmp_path, name, 4, new_id)
    assert listing(tmp_path) == [old[1], old[0], new]  # the newest step first (at one step, by name)

    write_owner(tmp_path, new_id)  # the new run saved last: resume=auto continues it, the old run resumes by path
    path, _, resumed_id, owned, tagged = decide("auto", "keep", tmp_path, CPU, said.append)
    assert (path, resumed_id, owned, tagged) == (new, new_id, [new], True)
    path, _, resumed_id, owned, tagged = decide(str(old[1]), "keep", tmp_path, CPU, said.append)
    assert (path, resumed_id, owned, tagged) == (old[1], "aaaaaaaaaaaa", old, True)
    assert said == []


def test_a_damaged_checkpoint_is_named_skipped_and_never_another_runs(tmp_path):
    """A one-file checkpoint cut short has no readable run id: it is said once as damaged, the run resumes the newest
    whole one and keeps its short names (the damaged file is no other run's), and it is pruned first, as this run's."""
    from distrib.checkpoint.folder import write_owner
    from distrib.checkpoint.resume import decide

    run = "aaaaaaaaaaaa"
    kept = [_write_of_run(tmp_path, f"step_{step:08d}", step, run) for step in (4, 8)]
    cut = _write_of_run(tmp_path, "step_00000012", 12, run)
    _truncate(cut)
    write_owner(tmp_path, run)
    said = []
    path, state, run_id, owned, tagged = decide("auto", "refuse", tmp_path, CPU, said.append)
    assert (path, run_id, tagged, owned) == (kept[1], run, False, [cut, *kept]) and state["progress"]["step"] == 8
    assert len(said) == 1 and said[0].startswith(f"checkpoint {cut}: unreadable (RuntimeError: "), said
    assert said[0].endswith("): damaged, so skipped (never resumed); deleted as this run prunes its older checkpoints")


def test_with_every_checkpoint_damaged_the_one_line_says_so_and_what_to_do(tmp_path):
    from distrib.checkpoint.folder import write_owner
    from distrib.checkpoint.resume import decide

    for step in (4, 8, 12):
        _truncate(_write_of_run(tmp_path, f"step_{step:08d}", step, "aaaaaaaaaaaa"))
    write_owner(tmp_path, "aaaaaaaaaaaa")
    said = []
    with pytest.raises(CheckpointError) as info:
        decide("auto", "refuse", tmp_path, CPU, said.append)
    assert said == [] and str(info.value).startswith(
        f"checkpoint.dir = '{tmp_path}': nothing to resume, its 3 checkpoint(s) that could continue the run are "
        f"damaged (the newest: checkpoint {tmp_path / 'step_00000012.pt'}: unreadable (")
    assert str(info.value).endswith("restore them from a copy and run the same command again, or start afresh with "
                                    "--set checkpoint.resume=never (the damaged files stay, unless a save takes one's "
                                    "name)")
    # the way out it names: a new run, not refused as beside "another run's" checkpoints, short names; a new run
    # never prunes what it did not write
    path, state, run_id, owned, tagged = decide("never", "refuse", tmp_path, CPU, said.append)
    assert (path, state, tagged, owned) == (None, None, False, []) and len(said) == 3


@pytest.mark.timeout(120)
def test_each_save_says_how_long_it_held_training_in_the_log_and_metrics_jsonl(tmp_path, monkeypatch, capsys):
    """The save of step 4 is made to take 0.25 s longer: its save_blocked_s (metrics.jsonl) is at least that, and the
    log line of each save says the same figure."""
    import json
    import re
    import time

    from distrib.checkpoint.format import FileStorage
    from distrib.config import load_config
    from distrib.worker import run_training

    real_write = FileStorage.write

    def slow_write(self, path, state, committed):
        if path.name == "step_00000004.pt":
            time.sleep(0.25)
        real_write(self, path, state, committed)

    monkeypatch.setattr(FileStorage, "write", slow_write)
    run_training(load_config(None, [*SMALL, f"run.dir={tmp_path}", "train.max_steps=6", "checkpoint.every_steps=4"]))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    saves = {r["step"]: r["save_blocked_s"] for r in records if "save_blocked_s" in r}
    assert sorted(saves) == [4, 6] and saves[4] >= 0.25 and 0 < saves[6], saves  # 6: the final checkpoint
    said = re.findall(r"saved (step_\d+\.pt) at step (\d+): training held (\d+\.\d+)s",
                      capsys.readouterr().err)
    assert [(name, int(step)) for name, step, _ in said] == [("step_00000004.pt", 4), ("step_00000006.pt", 6)]
    assert all(abs(float(seconds) - saves[int(step)]) <= 0.0005 + 1e-9 for _, step, seconds in said), said
