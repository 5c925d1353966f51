"""One checkpoint policy over both formats: two runs in one checkpoint.dir, keep_best, keep_last = 1 and dead
writers' temporary files behave the same under ddp (one file) and fsdp (DCP shards), and a checkpoint of either
format resumes under the other strategy to the uninterrupted run's weights."""

import os
from pathlib import Path

import pytest
import torch

from distrib.checkpoint import CheckpointError, policy
from distrib.checkpoint.folder import listing, read_stored, stored_run_id
from distrib.checkpoint.format import hold
from distrib.checkpoint.shard_dir import WRITER
from distrib.config import load_config
from distrib.distributed.runtime import open_runtime
from distrib.launch.rundir import LOCK_NAME
from distrib.worker import run_training, train_on
from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.support import assert_ok, load_weights, max_relative_diff

BASE = ["data.name=synthetic", "data.synthetic_train_size=256", "data.synthetic_test_size=64", "run.progress=false",
        "train.global_batch_size=32", "train.schedule=constant", "train.warmup_steps=2", "train.log_every=2",
        "train.eval_every_epochs=0", "dist.device=cpu", "dist.timeout_s=60"]
STRATEGIES = ["ddp", "fsdp"]


def _config(run_dir: Path, strategy: str, *overrides: str):
    return load_config(None, [*BASE, f"run.dir={run_dir}", f"dist.strategy={strategy}", *overrides])


def _train(run_dir: Path, strategy: str, *overrides: str) -> dict:
    return run_training(_config(run_dir, strategy, *overrides))


def _bytes(folder: Path) -> dict[str, bytes]:
    """Every file under folder (checkpoint directories' files too) and its bytes, but the lock."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in listing(folder))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_second_run_in_one_checkpoint_dir_is_refused_or_keeps_the_first_runs_checkpoints(tmp_path, strategy):
    """The data-loss case: run A (6 steps, a checkpoint every 2) leaves step 4 and 6; run B starts afresh beside it."""
    folder = tmp_path / "checkpoints"
    _train(tmp_path, strategy, "train.max_steps=6", "checkpoint.every_steps=2")
    suffix = ".pt" if strategy == "ddp" else ""
    assert _names(folder) == [f"step_00000004{suffix}", f"step_00000006{suffix}"]
    theirs, their_id = _bytes(folder), stored_run_id(listing(folder)[0])

    with pytest.raises(CheckpointError, match=r"another run \(newest step_00000006.*checkpoint.foreign=keep"):
        _train(tmp_path, strategy, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.resume=never")
    assert _bytes(folder) == theirs  # refused before it wrote or deleted anything

    # Told to keep them: B trains beside them to the end, through saves at A's step numbers (4 and 6), under names
    # of its own (step_N-RUNID), and prunes only its own (keep_last = 2: steps 5 and 6 stay).
    summary = _train(tmp_path, strategy, "train.max_steps=6", "checkpoint.every_steps=1", "checkpoint.resume=never",
                     "checkpoint.foreign=keep")
    assert summary["steps"] == 6
    after = _bytes(folder)
    assert {name: after[name] for name in theirs if name != ".distrib-run"} == \
        {name: data for name, data in theirs.items() if name != ".distrib-run"}  # A's, byte for byte
    ours = {stored_run_id(p) for p in listing(folder)} - {their_id}
    assert len(ours) == 1
    (our_id,) = ours
    assert _names(folder) == sorted([f"step_00000004{suffix}", f"step_00000006{suffix}",
                                     f"step_00000005-{our_id}{suffix}", f"step_00000006-{our_id}{suffix}"])

    # The folder stays shared: A resumes by path and extends to step 8 (its saves are named with its id now), B
    # then resumes automatically (it saved last), and neither touches the other's checkpoints.
    _train(tmp_path, strategy, "train.max_steps=8", "checkpoint.every_steps=2", "checkpoint.foreign=keep",
           f"checkpoint.resume={folder / f'step_00000006{suffix}'}")
    assert _names(folder) == sorted([f"step_00000006{suffix}", f"step_00000008-{their_id}{suffix}",
                                     f"step_00000005-{our_id}{suffix}", f"step_00000006-{our_id}{suffix}"])
    assert _train(tmp_path, strategy, "train.max_steps=8", "checkpoint.every_steps=2", "checkpoint.foreign=keep",
                  f"checkpoint.resume={folder / f'step_00000006-{our_id}{suffix}'}")["resumed_from_step"] == 6
    assert {stored_run_id(p) for p in listing(folder)} == {their_id, our_id}


def _crash_at(step: int):
    def on_step_end(done: int) -> None:
        if done == step:
            raise RuntimeError(f"crash after step {step}")

    return on_step_end


@pytest.mark.timeout(900)
def test_keep_best_under_fsdp_keeps_the_k_best_through_pruning_and_a_restart(tmp_path):
    # 8 steps per epoch, an evaluation after each of 5 epochs; keep_last = 1 prunes step_* on every save.
    best = ["train.max_steps=40", "train.eval_every_epochs=1", "train.lr=0.3", "checkpoint.every_steps=4",
            "checkpoint.keep_last=1", "checkpoint.keep_best=2", "checkpoint.best_metric=test_loss"]
    whole = _train(tmp_path / "whole", "fsdp", *best)
    config = _config(tmp_path / "parts", "fsdp", *best)
    with pytest.raises(RuntimeError, match="crash after step 30"), open_runtime(config.dist) as runtime:
        train_on(config, runtime, _crash_at(30))  # after the evaluations at 8, 16, 24 and the checkpoint at 28
    resumed = _train(tmp_path / "parts", "fsdp", *best)
    assert resumed["resumed_from_step"] == 28 and resumed["steps"] == 40

    kept = [(entry["step"], entry["value"]) for entry in resumed["best_checkpoints"]]
    assert kept == [(entry["step"], entry["value"]) for entry in whole["best_checkpoints"]] and len(kept) == 2
    folder = tmp_path / "parts" / "checkpoints"
    assert sorted(p.name for p in listing(folder, "best")) == sorted(f"best_{step:08d}" for step, _ in kept)
    for path in listing(folder, "best"):  # complete, verified sharded checkpoints that resume=PATH can name
        assert path.is_dir() and read_stored(path, torch.device("cpu"))["progress"]["step"] in dict(kept)
    assert _names(folder) == ["step_00000040"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_keep_last_1_never_leaves_the_folder_without_a_good_checkpoint(tmp_path, strategy, monkeypatch):
    real_remove, pruned = policy.remove, []

    def checked_remove(old: Path) -> None:  # at every prune, a newer checkpoint is already complete and verified
        newer = [p for p in listing(old.parent) if p != old]
        assert newer and read_stored(newer[0], torch.device("cpu"))["progress"]["step"] > int(old.name[5:13])
        pruned.append(old.name)
        real_remove(old)

    monkeypatch.setattr(policy, "remove", checked_remove)
    _train(tmp_path, strategy, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=1")
    suffix = ".pt" if strategy == "ddp" else ""
    assert pruned == [f"step_00000002{suffix}", f"step_00000004{suffix}"]
    assert _names(tmp_path / "checkpoints") == [f"step_00000006{suffix}"]
    resumed = _train(tmp_path, strategy, "train.max_steps=8", "checkpoint.every_steps=2", "checkpoint.keep_last=1")
    assert resumed["resumed_from_step"] == 6 and _names(tmp_path / "checkpoints") == [f"step_00000008{suffix}"]


def _temps(folder: Path) -> tuple[list[str], list[str], list[int]]:
    """Temporary files and directories of both formats: dead writers' (nobody holds them) and live ones' (this
    process holds their locks, as a writer does from its first byte to the rename). Returns (dead, live, fds)."""
    dead = [".step_00000008.pt.0123456789ab.4242.tmp", ".step_00000010.tmp", ".best_00000002.tmp",
            ".best_00000004.pt.0123456789ab.4242.tmp"]
    (folder / dead[0]).write_bytes(b"half a checkpoint")
    (folder / dead[1]).mkdir()
    (folder / dead[1] / "__0_0.distcp").write_bytes(b"half a shard")
    (folder / dead[1] / WRITER).write_bytes(b"")  # its writer died, so nobody holds the lock any more
    (folder / dead[2]).mkdir()  # killed before it even made its lock file
    (folder / dead[3]).write_bytes(b"half a best checkpoint")
    live = [".step_00000012.pt.feedfeedfeed.1.tmp", ".step_00000014.tmp"]
    fds = [hold(folder / live[0])]
    (folder / live[1]).mkdir()
    fds.append(hold(folder / live[1] / WRITER))
    return dead, live, fds


@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_dead_writers_temporary_files_are_removed_by_the_next_owner_and_a_live_ones_are_not(tmp_path, strategy,
                                                                                               capsys):
    _train(tmp_path, strategy, "train.max_steps=4", "checkpoint.every_steps=2")
    folder = tmp_path / "checkpoints"
    dead, live, fds = _temps(folder)  # of another run id (a killed first attempt), and of both formats
    try:
        resumed = _train(tmp_path, strategy, "train.max_steps=6", "checkpoint.every_steps=2")
        present = sorted(p.name for p in folder.iterdir())
    finally:
        for fd in fds:
            os.close(fd)
    assert resumed["resumed_from_step"] == 4
    assert not set(dead) & set(present) and set(live) <= set(present), present
    out = capsys.readouterr()
    assert all(f"removed {name}, left by a writer that died" in out.out + out.err for name in dead)


@pytest.mark.timeout(900)
def test_ddp_and_fsdp_checkpoints_resume_under_each_other_to_the_uninterrupted_weights(tmp_path):
    """ddp (steps 1-2) -> fsdp (3-4) -> ddp (5-6) on 2 workers, against 6 uninterrupted steps (one process, the same
    global batch): AdamW moments and EMA weights cross both ways, the shards of a 2-rank mesh from and into whole
    tensors."""
    common = ["train.optimizer=adamw", "train.ema_decay=0.9", "checkpoint.every_steps=2", "checkpoint.keep_last=1"]

    _train(tmp_path / "whole", "ddp", *common, "train.max_steps=6")
    # The three parts in one launch of 2 workers (each part a run of its own: opened, resumed, saved, closed).
    parts = {f"{strategy}-{steps}": [*BASE, *common, f"run.dir={tmp_path / 'parts'}", f"dist.strategy={strategy}",
                                      f"train.max_steps={steps}"]
             for strategy, steps in (("ddp", 2), ("fsdp", 4), ("ddp", 6))}
    result = torchrun_runs(2, parts, tmp_path)
    assert_ok(result)
    logs = list(split_runs(result.stderr, list(parts)).values())  # distrib's notes go to stderr
    assert "resumed in the" not in logs[0]
    for log, theirs in zip(logs[1:], ("one-file (ddp)", "sharded (fsdp)")):
        assert log.count(f"a {theirs} checkpoint resumed in the") == 1 and "both hold the full training state" in log
    assert max_relative_diff(load_weights(tmp_path / "parts"), load_weights(tmp_path / "whole")) < 1e-5
    ema = [torch.load(tmp_path / run / "model_ema.pt", weights_only=True) for run in ("parts", "whole")]
    assert max_relative_diff(*ema) < 1e-5
    assert _names(tmp_path / "parts" / "checkpoints") == ["step_00000006.pt"]  # keep_last = 1 pruned the shards too
