"""The fsdp strategy against references: ddp and one process (weights, metrics, model.pt, memory per rank), exact
and resharded resume from sharded checkpoints, a broken checkpoint, asynchronous writes (a thread's, a checkpoint
process's) cut short by SIGKILL and SIGTERM, and the finite check when only one rank's shard goes NaN."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distrib.checkpoint.resume import choose
from distrib.checkpoint.shard_dir import list_sharded
from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import torchrun_runs
from tests.helpers.processes import EVENT_S, Launches, clean_env, descendants, wait_for, worker_pid
from tests.helpers.support import REPO, assert_ok, free_port, kill_tree, load_weights, max_relative_diff, torchrun_train

# 203 test samples in batches of 50: 5 evaluation batches, 2 and 3 per rank at world size 2, so fsdp pads one.
BASE = ["data.name=synthetic", "data.synthetic_train_size=1536", "data.synthetic_test_size=203",
        "data.eval_batch_size=50", "run.progress=false", "train.global_batch_size=24", "train.grad_accum_steps=2",
        "train.grad_clip=0.5", "train.schedule=constant", "train.warmup_steps=3", "train.log_every=10",
        "train.max_steps=30", "checkpoint.every_steps=10", "checkpoint.keep_last=3", "dist.device=cpu",
        "dist.timeout_s=60"]
FSDP = ["dist.strategy=fsdp"]


def _sets(run_dir, *overrides) -> list[str]:
    return [a for o in [*BASE, f"run.dir={run_dir}", *overrides] for a in ("--set", o)]


def _summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def _final_shards(run_dir: Path, tmp_path: Path) -> dict:
    """The newest sharded checkpoint of a run, gathered into one plain dict (model and optimizer) off-line."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"flat_{Path(run_dir).name}.pt"
    dcp_to_torch_save(list_sharded(Path(run_dir) / "checkpoints")[0], out)
    return torch.load(out, weights_only=False)


def _assert_bitwise(a: dict, b: dict) -> None:
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        assert torch.equal(value, flat_b[key]) if isinstance(value, torch.Tensor) else value == flat_b[key], key


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}/").items()}
    return {prefix: tree}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> Path:
    """One launch of 2 workers (train_runs.py), two runs: the uninterrupted fsdp run (fsdp/, checkpoints at steps 10,
    20, 30) that the others are compared with, then ddp with activation checkpointing on named blocks (ddp/)."""
    root = tmp_path_factory.mktemp("two_workers")
    assert_ok(torchrun_runs(2, {"fsdp": [*BASE, f"run.dir={root / 'fsdp'}", *FSDP],
                                "ddp": [*BASE, f"run.dir={root / 'ddp'}", "speed.activation_checkpointing=blocks",
                                        'dist.shard_modules=["Linear", "Conv2d"]']}, root))
    return root


@pytest.fixture(scope="module")
def fsdp_whole(two_workers) -> Path:
    return two_workers / "fsdp"


@pytest.mark.timeout(900)
def test_fsdp_and_ddp_at_world_size_2_equal_one_process(tmp_path, two_workers, fsdp_whole):
    one = run_training(load_config(None, [*BASE, f"run.dir={tmp_path}/one"]))
    # ddp with activation checkpointing on named blocks: recomputing changes memory, not the result
    ddp, fsdp = _summary(two_workers / "ddp"), _summary(fsdp_whole)
    reference = load_weights(tmp_path / "one")
    for run_dir in (two_workers / "ddp", fsdp_whole):
        weights = load_weights(run_dir)
        assert list(weights) == list(reference)  # model.pt: the same keys, in order, and shapes as ddp's
        assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in reference.items()}
        assert max_relative_diff(weights, reference) < 1e-5
    assert max_relative_diff(load_weights(fsdp_whole), load_weights(two_workers / "ddp")) < 1e-5
    for summary in (ddp, fsdp):  # exact evaluation: every sample once, padded forwards not counted
        assert summary["steps"] == 30 and summary["test_count"] == one["test_count"] == 203
        assert summary["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    assert fsdp["world_size"] == ddp["world_size"] == 2
    assert ddp["state_bytes_per_rank"] == one["state_bytes_per_rank"] > 0
    assert fsdp["state_bytes_per_rank"] <= 0.55 * ddp["state_bytes_per_rank"]
    assert fsdp["peak_memory_bytes"] is None  # CUDA only


@pytest.mark.timeout(900)
def test_sharded_checkpoint_resumes_at_world_sizes_1_and_3(tmp_path, fsdp_whole, capsys):
    """The step-10 checkpoint of the 2-worker run, resumed at 1 and 3 (float noise; at 2 it is bitwise: the process
    saves' test, whose worker is killed); at world size 1 the step-20 one lacks rank 1's shard file, so it is refused
    and step 10 used (there with activation checkpointing, which must not change the result)."""
    source = fsdp_whole / "checkpoints"
    for name in ("one", "three"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(source / "step_00000010", tmp_path / name / "checkpoints" / "step_00000010")
    broken = tmp_path / "one" / "checkpoints" / "step_00000020"
    shutil.copytree(source / "step_00000020", broken)
    (broken / "__1_0.distcp").unlink()

    one = run_training(load_config(None, [*BASE, f"run.dir={tmp_path}/one", *FSDP,
                                          "speed.activation_checkpointing=blocks"]))
    assert one["world_size"] == 1 and one["resumed_from_step"] == 10
    assert "step_00000020: __1_0.distcp is missing" in capsys.readouterr().err
    assert max_relative_diff(load_weights(tmp_path / "one"), load_weights(fsdp_whole)) < 1e-5

    assert_ok(torchrun_train(3, *_sets(tmp_path / "three", *FSDP)))
    assert _summary(tmp_path / "three")["resumed_from_step"] == 10
    assert max_relative_diff(load_weights(tmp_path / "three"), load_weights(fsdp_whole)) < 1e-5


@pytest.mark.timeout(900)
def test_a_dead_checkpoint_process_is_replaced_and_a_kill_during_an_async_write_is_never_resumed_from(tmp_path):
    """async_save_loop.py saves at every step through its checkpoint process (checkpoint.async_save = process). That
    process SIGKILLed: one line says so at once, the next save is written by the training process and says what died
    (and the write lost with it), a new checkpoint process writes the ones after, and the loop saves on. Then the
    loop is killed while a write is in flight: the partial write is never resumed from."""
    import torch.distributed.checkpoint as dcp

    directory, out = tmp_path / "checkpoints", tmp_path / "loop.out"
    for attempt in range(3):  # the kill must land while a write is in flight: nearly always on the first try
        shutil.rmtree(directory, ignore_errors=True)  # each try counts from step 1 again
        script = REPO / "tests" / "helpers" / "async_save_loop.py"
        with open(out, "w") as sink:
            proc = subprocess.Popen([sys.executable, str(script), str(directory), "process"], stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if attempt == 0:
                _its_checkpoint_process_killed_and_replaced(proc, directory, out)
            wait_for(lambda: len(list_sharded(directory)) >= 2 and list(directory.glob(".step_*.tmp")), EVENT_S,
                     "a committed checkpoint and a write in flight", [proc])
        finally:
            kill_tree(proc)
        if list(directory.glob(".step_*.tmp")):
            break
    partial = list(directory.glob(".step_*.tmp"))
    assert partial, "no write was in flight when the loop was killed"
    newest = list_sharded(directory)[0]
    assert newest.name < partial[0].name[1:]  # the partial one is the newer step, and is not listed
    path, state = choose("auto", directory, torch.device("cpu"), print)
    assert path == newest and f"step_{state['progress']['step']:08d}" == newest.name
    shards = {"model": {"weight": torch.zeros(2048, 2048), "bias": torch.zeros(2048)}}
    dcp.load(shards, checkpoint_id=path)
    assert bool((shards["model"]["weight"] == state["progress"]["step"]).all())  # staged whole, not mid-update


def _its_checkpoint_process_killed_and_replaced(proc: subprocess.Popen, directory: Path, out: Path) -> None:
    writer = wait_for(lambda: list_sharded(directory) and next(iter(_checkpoint_processes(proc.pid)), None), EVENT_S,
                      "a checkpoint written through the checkpoint process", [proc])
    os.kill(writer, signal.SIGKILL)
    died = f"rank 0's checkpoint process (pid {writer}, killed by SIGKILL) died"
    said = wait_for(lambda: [line for line in out.read_text().splitlines() if died in line][1:] and out.read_text(),
                    EVENT_S, "the line of the save after the kill", [proc])
    lines = [line for line in said.splitlines() if died in line]
    at_once = f"distrib: warning: {died}; the next checkpoint is written without it and starts new ones"
    assert len(lines) == 2 and at_once in lines and "Traceback" not in said, said  # said at once, by its rank
    replaced = re.fullmatch(rf"distrib: warning: {re.escape(died)}(?:, and the write of (step_\d+) with it)?; "
                            r"checkpoint (step_\d+) was written by the training processes, the next ones by new "
                            r"checkpoint processes", lines[1 - lines.index(at_once)])
    assert replaced, said
    wait_for(lambda: [child for child in _checkpoint_processes(proc.pid) if child != writer], EVENT_S,
             "a new checkpoint process", [proc])
    wait_for(lambda: _step(list_sharded(directory)[0].name) >= _step(replaced[2]) + 2, EVENT_S,
             "checkpoints written through the new checkpoint process", [proc])
    assert replaced[1] is None or not (directory / f".{replaced[1]}.tmp").exists()  # a lost write: removed


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _checkpoint_processes(pid: int) -> list[int]:
    """The checkpoint processes (multiprocessing's spawn) below process pid."""
    return [child for child in descendants(pid) if b"spawn_main" in _read(child, "cmdline")]


def _of_launch(variable: bytes) -> list[int]:
    """Every process on the machine, wherever it was reparented, whose environment holds `variable` (NAME=VALUE)."""
    return [int(entry.name) for entry in Path("/proc").glob("[0-9]*")
            if variable in _read(int(entry.name), "environ").split(b"\0")]


def _write_in_flight(run_dir: Path, marker: str, launch: subprocess.Popen) -> tuple[str, int]:
    """Once a run saves through its checkpoint processes (a checkpoint committed, the next one's folder there):
    rank 0's checkpoint process stopped (SIGSTOP), so that the write in flight stays in flight. Returns the
    folder's name and that process's pid."""
    directory = run_dir / "checkpoints"
    wait_for(lambda: list_sharded(directory), EVENT_S, f"a checkpoint of {run_dir.name}", [launch])
    child = wait_for(lambda: (rank0 := worker_pid(marker, 0)) and next(iter(_checkpoint_processes(rank0)), None),
                     EVENT_S, "rank 0's checkpoint process", [launch])
    while True:
        partial = wait_for(lambda: list(directory.glob(".step_*.tmp")), EVENT_S, f"a write of {run_dir.name}",
                           [launch], poll_s=0.005)
        os.kill(child, signal.SIGSTOP)
        if partial[0].exists():  # else it was committed in between: the next one
            return partial[0].name, child
        os.kill(child, signal.SIGCONT)


@pytest.mark.timeout(900)
def test_process_saves_cut_by_sigkill_and_sigterm_are_never_torn_and_resume_bitwise(tmp_path, fsdp_whole):
    """checkpoint.async_save = process under fsdp, one run in one launch of 2 workers (--max-restarts 2). Worker 1
    SIGKILLed while a write is in flight: the restart removes the partial write and resumes from the one before. Then
    SIGTERM to both workers' process groups (their checkpoint processes' too) while the next attempt's write is in
    flight: the write is finished, the run checkpoints and ends with 75, the restart resumes it. No checkpoint process
    outlives its rank or its run, and the run ends bitwise equal to the uninterrupted one (model.pt, and the sharded
    model and optimizer). (hsdp saves through the same checkpoint process and group.)"""
    run_dir = tmp_path / "run"
    marker = f"run.dir={run_dir}"
    cmd = [sys.executable, "-m", "distrib", "launch", "--nproc-per-node=2", "--max-restarts=2", "-m", "distrib",
           "train", *_sets(run_dir, *FSDP, "checkpoint.async_save=process", "checkpoint.every_steps=5")]
    env = clean_env(OMP_NUM_THREADS="1")  # one thread, as fsdp_whole's torchrun workers
    with Launches(tmp_path) as launches:
        launch = launches.procs[launches.start(cmd, env)][0]
        stderr = Path(f"{launches.procs[0][1]}.err")
        torn, stopped = _write_in_flight(run_dir, marker, launch)
        writers = _checkpoint_processes(launch.pid)
        # distrib launch's file for hang dumps, in a folder of its own: every process of this launch inherits it
        note = next(item for item in _read(stopped, "environ").split(b"\0") if item.startswith(b"DISTRIB_HANG_NOTE="))
        os.kill(worker_pid(marker, 1), signal.SIGKILL)
        wait_for(lambda: not any(map(_alive, writers)), EVENT_S, "the end of the killed attempt's checkpoint processes")
        # the restart's first act: the partial write gone (its next write may take the same name)
        wait_for(lambda: f"removed {torn}," in stderr.read_text(), EVENT_S, f"the removal of {torn}", [launch])
        in_flight, stopped = _write_in_flight(run_dir, marker, launch)
        writers = _checkpoint_processes(launch.pid)
        for rank in (0, 1):
            os.killpg(worker_pid(marker, rank), signal.SIGTERM)  # each worker leads its process group (its lifeline)
        time.sleep(1)  # the signal lands while the write is in flight, which then goes on
        os.kill(stopped, signal.SIGCONT)
        wait_for(lambda: not any(map(_alive, writers)), EVENT_S, "the end of the preempted run's checkpoint processes")
        [done] = launches.wait(timeout=EVENT_S)
    assert done.returncode == 0 and not _of_launch(note), done.text()  # no checkpoint process outlived its run
    said = done.stderr
    assert f"removed {torn}, left by a writer that died" in said and said.count("left by a writer that died") == 1, \
        done.text()  # the killed attempt's partial write; the preempted one's in-flight write was finished
    assert f"resumed at step {_step(torn) - 5} " in said, done.text()  # the one before the torn write
    preempted = re.search(r"preempted at step (\d+); checkpoint \S+/run/checkpoints/step_0*\1;", said)
    assert preempted and int(preempted[1]) > _step(in_flight), done.text()
    summary = _summary(run_dir)
    assert summary["restart_count"] == 2 and summary["resumed_from_step"] == int(preempted[1])
    _assert_bitwise(_final_shards(run_dir, tmp_path), _final_shards(fsdp_whole, tmp_path))
    _assert_bitwise(load_weights(run_dir), load_weights(fsdp_whole))


def _step(name: str) -> int:
    """.step_00000010.tmp -> 10"""
    return int(re.search(r"step_(\d+)", name)[1])


@pytest.mark.timeout(900)
def test_a_nan_in_one_ranks_shard_stops_every_rank_at_the_same_step(tmp_path):
    """Two workers started by hand, with no agent to kill the second when the first fails: each must stop on its
    own, with the same error at the same step (rank 0's shard is finite; a rank that went on would time out)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    args = _sets(tmp_path, *FSDP, "model.factory=tests.helpers.factories:nan_grad_in_one_shard", "dist.timeout_s=20")
    procs = [subprocess.Popen([sys.executable, "-m", "distrib", "train", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in (0, 1)]
    try:
        outs = [proc.communicate(timeout=EVENT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            kill_tree(proc)
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 2, (rank, out[-3000:])
        # at once on the CPU, or at the next sync step (step 10) where the flags ride the agreement's all-reduce
        assert re.search(r"^distrib: error: train gradients are not finite (at step 1|between steps 1 and 10) ", out,
                         re.M), (rank, out[-3000:])


@pytest.mark.timeout(900)
def test_ema_shards_are_checkpointed_and_resume_bitwise(tmp_path):
    """Under fsdp the EMA's entries are DTensors: DCP writes them with the model's shards. A run stopped at step 6
    and resumed ends with model_ema.pt (and model.pt) bitwise equal to the uninterrupted run's."""
    from tests.helpers.support import small_config

    common = ("dist.strategy=fsdp", "train.ema_decay=0.9", "train.schedule_steps=12", "checkpoint.every_steps=6")
    run_training(small_config(tmp_path / "whole", *common, "train.max_steps=12"))
    run_training(small_config(tmp_path / "resumed", *common, "train.max_steps=6"))
    summary = run_training(small_config(tmp_path / "resumed", *common, "train.max_steps=12"))
    assert summary["resumed_from_step"] == 6
    for name in ("model.pt", "model_ema.pt"):
        whole, resumed = (torch.load(tmp_path / run_dir / name, weights_only=True) for run_dir in ("whole", "resumed"))
        assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole), name
    # The average differs from the weights (so the check above compares a real EMA, not a copy of model.pt).
    ema, weights = (torch.load(tmp_path / "whole" / name, weights_only=True) for name in ("model_ema.pt", "model.pt"))
    assert any(not torch.equal(ema[k], weights[k]) for k in weights if weights[k].is_floating_point())


@pytest.mark.timeout(900)
def test_fsdp_without_resharding_after_forward_trains_like_the_default(tmp_path):
    """dist.reshard_after_forward = false keeps parameters gathered after a forward until a backward: the strategy
    reshards after the pre-flight checks and after each evaluation (forwards only), so the optimizer holds the shards
    (it once held the gathered tensors and never stepped) and a checkpoint after an evaluation saves (it once
    crashed in torch's state_dict helpers). Bitwise the default's weights: resharding moves no value."""
    common = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 2, dim = 32}", "data.name=text",
              "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32", "train.global_batch_size=16",
              "train.optimizer=adamw", "train.warmup_steps=2", "train.epochs=0", "train.max_steps=6",
              "checkpoint.every_steps=3", "run.progress=false", "dist.device=cpu", "dist.strategy=fsdp"]
    for name, reshard in (("default", "true"), ("kept", "false")):
        summary = run_training(load_config(None, [*common, f"dist.reshard_after_forward={reshard}",
                                                  f"run.dir={tmp_path / name}"]))
        assert summary["steps"] == 6
    kept, default = load_weights(tmp_path / "kept"), load_weights(tmp_path / "default")
    assert kept.keys() == default.keys() and all(torch.equal(kept[key], default[key]) for key in default)
