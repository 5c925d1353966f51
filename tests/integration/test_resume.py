"""Exact resume against an uninterrupted reference: stop and resume, a killed worker restarted by the launcher,
SIGTERM, and a checkpoint moved to another world size."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import launch_runs, split_runs
from tests.helpers.processes import EVENT_S, wait_for
from tests.helpers.support import REPO, assert_ok, kill_tree, max_relative_diff
from tests.helpers.support import run as run_cmd

BASE = ["data.name=synthetic", "data.synthetic_train_size=1536", "data.synthetic_test_size=200", "run.progress=false",
        "train.global_batch_size=32", "train.schedule=constant", "train.warmup_steps=5", "train.log_every=10",
        "checkpoint.every_steps=0", "dist.device=cpu"]


def _sets(run_dir, *overrides):
    return [a for o in [*BASE, f"run.dir={run_dir}", *overrides] for a in ("--set", o)]


def _final(run_dir: Path) -> dict:
    """The newest checkpoint of a finished run: model, optimizer, scheduler and progress."""
    newest = sorted((Path(run_dir) / "checkpoints").glob("step_*.pt"))[-1]
    return torch.load(newest, weights_only=True)


def _summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a["progress"] == b["progress"]
    for part in ("model", "optimizer", "scheduler"):
        flat_a, flat_b = _flatten(a[part]), _flatten(b[part])
        assert flat_a.keys() == flat_b.keys(), part
        for key in flat_a:
            if isinstance(flat_a[key], torch.Tensor):
                assert torch.equal(flat_a[key], flat_b[key]), (part, key)
            else:
                assert flat_a[key] == flat_b[key], (part, key)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}/").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in _flatten(sub, f"{prefix}{i}/").items()}
    return {prefix: tree}


@pytest.mark.timeout(900)
def test_stop_and_resume_is_bitwise_at_world_size_1(tmp_path):
    # 25 is mid-epoch (48 steps per epoch) and the rest crosses an epoch boundary.
    run_training(load_config(None, [*BASE, f"run.dir={tmp_path}/whole", "train.max_steps=60"]))
    run_training(load_config(None, [*BASE, f"run.dir={tmp_path}/parts", "train.max_steps=25"]))
    resumed = run_training(load_config(None, [*BASE, f"run.dir={tmp_path}/parts", "train.max_steps=60"]))
    assert resumed["resumed_from_step"] == 25 and resumed["steps"] == 60
    _assert_bitwise(_final(tmp_path / "parts"), _final(tmp_path / "whole"))
    assert _final(tmp_path / "whole")["progress"]["step"] == 60


LONG = ["train.max_steps=200", "train.schedule=cosine", "checkpoint.every_steps=20"]
CUT = ["checkpoint.every_steps=10"]

# 16 steps an epoch, DataLoader workers; a model that kills one rank once where model.kwargs says (no marker: never).
LOADER_RUN = ["data.name=synthetic", "data.synthetic_train_size=512", "data.synthetic_test_size=64",
              "data.loader=dataloader", "data.num_workers=2", "train.max_steps=12", "train.global_batch_size=32",
              "train.warmup_steps=2", "checkpoint.every_steps=4", "run.progress=false", "dist.device=cpu",
              "model.factory=tests.helpers.probe_env:network_dying_once"]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> Path:
    """Every 2-worker run of this module that a test does not start itself, in one launch (the workers' start-up is
    most of a short run's cost): `distrib launch --max-restarts 1` of train_runs.py, one thread per worker (distrib's
    launcher would share out the cores, and a convolution's bits depend on its thread count). First the killed-worker
    test's run (killed/), whose rank 1 dies in its first attempt; then, in the second attempt only, the 200-step
    reference of the SIGTERM test (long/), a 60-step run (whole/) beside one stopped at 25, mid-epoch (48 steps per
    epoch), and resumed across the epoch end (parts/), the same with its checkpoint of step 25 cut short before the
    resume (cut/), and the killed run's reference (loader/). The launch's output is in launch.out and launch.err."""
    root = tmp_path_factory.mktemp("two_workers")
    runs = [("killed", {}, [*LOADER_RUN, f"run.dir={root / 'killed'}",
                            f"model.kwargs={{marker='{root / 'died'}', at_forward=7, rank=1}}"]),
            ("long", {}, [*BASE, f"run.dir={root / 'long'}", *LONG]),
            ("whole", {}, [*BASE, f"run.dir={root / 'whole'}", "train.max_steps=60"]),
            ("parts-25", {}, [*BASE, f"run.dir={root / 'parts'}", "train.max_steps=25"]),
            ("parts-60", {}, [*BASE, f"run.dir={root / 'parts'}", "train.max_steps=60"]),
            ("cut-25", {}, [*BASE, f"run.dir={root / 'cut'}", *CUT, "train.max_steps=25"]),
            ("cut-60", {"TRAIN_RUNS_CUT": str(root / "cut" / "checkpoints" / "step_00000025.pt")},
             [*BASE, f"run.dir={root / 'cut'}", *CUT, "train.max_steps=60"]),
            ("loader", {}, [*LOADER_RUN, f"run.dir={root / 'loader'}"])]
    done = launch_runs([sys.executable, "-m", "distrib", "launch", "--nproc-per-node=2", "--max-restarts=1"], runs,
                       root, env={"OMP_NUM_THREADS": "1"})
    (root / "launch.out").write_text(done.stdout)
    (root / "launch.err").write_text(done.stderr)
    assert_ok(done)
    return root


@pytest.mark.timeout(900)
def test_stop_and_resume_at_world_size_2_and_move_the_checkpoint_to_world_size_1(tmp_path, two_workers):
    assert _summary(two_workers / "parts")["resumed_from_step"] == 25
    _assert_bitwise(_final(two_workers / "parts"), _final(two_workers / "whole"))

    (tmp_path / "moved" / "checkpoints").mkdir(parents=True)
    shutil.copy(two_workers / "parts" / "checkpoints" / "step_00000025.pt", tmp_path / "moved" / "checkpoints")
    moved = run_training(load_config(None, [*BASE, f"run.dir={tmp_path}/moved", "train.max_steps=60"]))
    assert moved["world_size"] == 1 and moved["resumed_from_step"] == 25
    assert max_relative_diff(_final(tmp_path / "moved")["model"], _final(two_workers / "whole")["model"]) < 1e-5


@pytest.mark.timeout(900)
def test_a_newest_checkpoint_cut_short_is_named_damaged_and_the_one_before_resumes_bitwise(two_workers):
    """cut/ stopped at 25 (checkpoints 20 and 25), then step_00000025.pt cut to half its bytes: the resume says one
    line naming it damaged, resumes from 20 and ends bitwise equal to the uninterrupted run; the damaged file is no
    other run's (no checkpoint is named with a run id) and this run's pruning deletes it."""
    said = split_runs((two_workers / "launch.err").read_text(), ["cut-60", "loader"])["cut-60"]
    damaged = [line for line in said.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and "step_00000025.pt: unreadable (" in damaged[0], said
    assert damaged[0].endswith("damaged, so skipped (never resumed); deleted as this run prunes its older checkpoints")
    assert _summary(two_workers / "cut")["resumed_from_step"] == 20
    _assert_bitwise(_final(two_workers / "cut"), _final(two_workers / "whole"))
    names = sorted(path.name for path in (two_workers / "cut" / "checkpoints").iterdir() if path.name[0] != ".")
    assert names == ["step_00000050.pt", "step_00000060.pt"], names


@pytest.mark.timeout(900)
def test_a_changed_global_batch_is_refused_unless_allowed(tmp_path):
    from distrib.checkpoint.format import CheckpointError

    run_training(load_config(None, [*BASE, f"run.dir={tmp_path}", "train.max_steps=12"]))
    with pytest.raises(CheckpointError, match=r"train.global_batch_size: 32 -> 64.*allow_config_change=true"):
        run_training(load_config(None, [*BASE, f"run.dir={tmp_path}", "train.max_steps=20",
                                        "train.global_batch_size=64"]))
    allowed = run_training(load_config(None, [*BASE, f"run.dir={tmp_path}", "train.max_steps=20",
                                              "train.global_batch_size=64", "checkpoint.allow_config_change=true"]))
    assert allowed["resumed_from_step"] == 12 and allowed["steps"] == 20
    # 12 steps x 32 samples = 384 samples into epoch 0 = step 6 of 64 samples: the same data position.
    assert _final(tmp_path)["progress"] == {"step": 20, "epoch": 0, "step_in_epoch": 14, "samples_in_epoch": 896}


@pytest.fixture(scope="module")
def long_reference(two_workers) -> dict:
    """The uninterrupted 2-worker run that one stopped by SIGTERM must reproduce bitwise (200 steps: the signal's
    margin)."""
    return _final(two_workers / "long")


@pytest.mark.timeout(900)
def test_a_rank_killed_beside_dataloader_workers_is_one_line_and_the_restart_resumes_bitwise(two_workers):
    """The first run of two_workers' launch, with data.num_workers = 2: rank 1 is SIGKILLed in step 7 (after
    checkpoint 4). The survivor says one line naming it (its DataLoader workers ignore the launcher's SIGTERM, so
    none dies under it), both are restarted, and the run ends bitwise equal to the uninterrupted one; nothing in the
    output is a traceback."""
    stdout, stderr = ((two_workers / name).read_text() for name in ("launch.out", "launch.err"))
    output = stdout + split_runs(stderr, ["killed", "long"])["killed"]  # both attempts, to the next run's start
    summary = _summary(two_workers / "killed")
    assert (two_workers / "died").exists() and summary["restart_count"] == 1 and summary["resumed_from_step"] == 4
    assert "Traceback" not in stdout + stderr, stdout + stderr
    assert re.search(r"^distrib: error: after step \d+: lost rank 1 \(host \S+, pid \d+, ", output, re.M), output
    assert len([line for line in output.splitlines() if "error" in line.lower()]) == 1, output
    _assert_bitwise(_final(two_workers / "killed"), _final(two_workers / "loader"))
    weights, reference = (torch.load(two_workers / run / "model.pt", weights_only=True) for run in ("killed", "loader"))
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in reference)


def _stop_with_sigterm(cmd: list[str], checkpoint: Path) -> str:
    """Starts cmd, waits for its first checkpoint, sends SIGTERM; it must be gone with exit 75 within 30 s, or on a
    loaded machine within the time it took to start, train to that checkpoint and write it (stopping takes at most
    the steps to the next sync step and one checkpoint)."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(checkpoint.exists, EVENT_S, checkpoint.name, [proc])
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=EVENT_S)
        stopping, starting = time.monotonic() - sent, sent - started
        assert stopping < max(30.0, starting), f"stopped {stopping:.1f}s after SIGTERM, first checkpoint after " \
                                               f"{starting:.1f}s"
    finally:
        kill_tree(proc)
    assert proc.returncode == 75, out[-3000:]
    assert out.count("preempted at step") == 1, out[-3000:]  # rank 0's line, not one per rank
    return out


@pytest.mark.timeout(1200)
def test_sigterm_to_the_launcher_checkpoints_exits_75_and_the_next_run_resumes(tmp_path, long_reference):
    cmd = [sys.executable, "-m", "distrib", "train", "--nproc-per-node", "2", *_sets(tmp_path, *LONG)]
    _stop_with_sigterm(cmd, tmp_path / "checkpoints" / "step_00000020.pt")
    stopped_at = _final(tmp_path)["progress"]["step"]
    assert 20 <= stopped_at < 200
    # One thread per worker, as in the stopped half (this process's, from conftest) and the reference: distrib's
    # launcher would share out the cores, and a convolution's bits depend on its thread count.
    assert_ok(run_cmd(cmd, timeout=EVENT_S, env={"OMP_NUM_THREADS": "1"}))
    assert _summary(tmp_path)["resumed_from_step"] == stopped_at
    _assert_bitwise(_final(tmp_path), long_reference)


@pytest.mark.timeout(900)
def test_sigterm_to_one_process_checkpoints_exits_75_and_the_next_run_resumes(tmp_path):
    steps = ["train.max_steps=150", "train.schedule=cosine", "checkpoint.every_steps=20"]
    run_training(load_config(None, [*BASE, f"run.dir={tmp_path}/whole", *steps]))
    cmd = [sys.executable, "-m", "distrib", "train", *_sets(tmp_path / "stopped", *steps)]
    _stop_with_sigterm(cmd, tmp_path / "stopped" / "checkpoints" / "step_00000020.pt")
    stopped_at = _final(tmp_path / "stopped")["progress"]["step"]
    assert 20 <= stopped_at < 150
    resumed = run_training(load_config(None, [*BASE, f"run.dir={tmp_path}/stopped", *steps]))
    assert resumed["resumed_from_step"] == stopped_at
    _assert_bitwise(_final(tmp_path / "stopped"), _final(tmp_path / "whole"))


def _lrs(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["lr"] for line in lines if "lr" in line}


@pytest.mark.timeout(900)
def test_extending_a_run_keeps_its_schedule_only_with_schedule_steps(tmp_path):
    """train.schedule_steps fixes the cosine's length: stopping at 12 and extending to 24 is bitwise the 24-step run.
    Without it, the extension recomputes the schedule: the learning rate jumps from 0 back up."""
    cosine = ["train.schedule=cosine", "train.warmup_steps=2", "train.log_every=1", "train.lr=0.05"]
    run_training(load_config(None, [*BASE, *cosine, f"run.dir={tmp_path}/whole", "train.max_steps=24"]))
    for name, fixed in (("fixed", ["train.schedule_steps=24"]), ("recomputed", [])):
        for steps in (12, 24):
            run_training(load_config(None, [*BASE, *cosine, *fixed, f"run.dir={tmp_path}/{name}",
                                            f"train.max_steps={steps}"]))
    _assert_bitwise(_final(tmp_path / "fixed"), _final(tmp_path / "whole"))
    assert _lrs(tmp_path / "fixed") == _lrs(tmp_path / "whole")
    recomputed = _lrs(tmp_path / "recomputed")
    assert recomputed[12] == 0.0 and recomputed[13] == pytest.approx(0.5 * 0.05)  # from 0 back to half the peak


FIT_LAUNCH = [sys.executable, "-m", "distrib", "launch", "--nproc-per-node", "2",
              str(REPO / "tests" / "helpers" / "fit_preempted.py")]


@pytest.mark.timeout(900)
def test_sigterm_in_a_fit_script_exits_75_without_traceback_and_the_rerun_resumes_bitwise(tmp_path):
    """A worker of a distrib.fit script under distrib launch sends itself SIGTERM in step 6 of its first fit: every
    rank checkpoints, says one line and ends with 75 (distrib.Preempted, a SystemExit), so does the launcher, which
    calls it a preemption (no line says failure); the same command then resumes and ends bitwise equal to the
    uninterrupted run, which its second fit (never reached by the stopped command) trains in the same processes.
    (One process stopped by SIGTERM: test_sigterm_to_one_process_checkpoints_exits_75_and_the_next_run_resumes.)"""
    env = {"PYTHONPATH": str(REPO)}
    cmd = [*FIT_LAUNCH, str(tmp_path / "stopped"), str(tmp_path / "whole")]
    stopped = run_cmd(cmd, timeout=EVENT_S, env={**env, "DISTRIB_TEST_DIE_AT": "6", "DISTRIB_TEST_DIE_RANK": "0",
                                                  "DISTRIB_TEST_DIE_SIGNAL": "SIGTERM"})
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 75, output
    assert not (tmp_path / "whole").exists()
    stopped_at = _final(tmp_path / "stopped")["progress"]["step"]  # the first step the ranks agree at, from 6 on
    assert "Traceback" not in output and f"distrib: preempted at step {stopped_at}; checkpoint" in output, output
    assert 6 <= stopped_at < 16
    # A preemption of the workers, not of the launcher: said as one, not a failure. Both ranks end with 75, or the one
    # whose exit reaches the agent first does and the launcher stops the other (rank 0 says the preemption line,
    # rank 1 ends quietly: either may be first).
    assert re.search(r"distrib launch: ranks? [01](, 1)? \(.*\) (was|were) preempted \(exit 75", output), output
    assert "distrib launch: the run was preempted; exit 75" in output and "failure" not in output, output
    assert_ok(run_cmd(cmd, timeout=EVENT_S, env=env))
    assert _summary(tmp_path / "stopped")["resumed_from_step"] == stopped_at
    assert _summary(tmp_path / "whole")["resumed_from_step"] is None  # trained from step 0 without a stop
    _assert_bitwise(_final(tmp_path / "stopped"), _final(tmp_path / "whole"))
