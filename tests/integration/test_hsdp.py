"""hsdp (FSDP2 on a 2 x 2 mesh, gloo) against ddp at world size 4, its memory per rank, and its sharded checkpoint
resumed as fsdp at world size 2 and as ddp in one process; distrib plan's state_bytes_per_rank against what these
runs measure (ddp, fsdp, hsdp at world sizes 1, 2, 4); the mesh's refusals."""

import json
import shutil
from pathlib import Path

import pytest

from distrib.config import load_config
from distrib.plan import Machine, plan_run
from distrib.worker import run_training
from tests.helpers.processes import EVENT_S
from tests.helpers.support import SMALL, assert_ok, load_weights, max_relative_diff, sets, small_config, torchrun_train

# 12 steps of 32 samples, checkpoints at 6 and 12: short, so float noise across world sizes stays far below 1e-5.
STEPS = ("data.synthetic_train_size=512", "train.max_steps=12", "train.warmup_steps=3", "checkpoint.every_steps=6",
         "train.grad_clip=0.5")
HSDP = ("dist.strategy=hsdp", "dist.shard_size=2")


def _train(nproc: int, run_dir: Path, *overrides: str) -> dict:
    assert_ok(torchrun_train(nproc, *sets(*SMALL, *STEPS, f"run.dir={run_dir}", *overrides), timeout=EVENT_S))
    return _summary(run_dir)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def hsdp_whole(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("hsdp_whole")
    _train(4, run_dir, *HSDP)
    return run_dir


@pytest.fixture(scope="module")
def ddp_four(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ddp_four")
    _train(4, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, hsdp_whole) -> dict[str, Path]:
    """The hsdp run's step-6 checkpoint continued as fsdp at world size 2 and as ddp in one process."""
    tmp = tmp_path_factory.mktemp("resumed")
    for name in ("fsdp", "ddp"):
        (tmp / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(hsdp_whole / "checkpoints" / "step_00000006", tmp / name / "checkpoints" / "step_00000006")
    _train(2, tmp / "fsdp", "dist.strategy=fsdp")
    run_training(small_config(tmp / "ddp", *STEPS))
    return {"fsdp": tmp / "fsdp", "ddp": tmp / "ddp"}


@pytest.mark.timeout(900)
def test_hsdp_2x2_trains_like_ddp_at_world_size_4_with_half_the_state(hsdp_whole, ddp_four):
    hsdp, ddp = _summary(hsdp_whole), _summary(ddp_four)
    assert hsdp["world_size"] == ddp["world_size"] == 4 and hsdp["steps"] == 12
    assert max_relative_diff(load_weights(hsdp_whole), load_weights(ddp_four)) < 1e-5
    assert hsdp["test_count"] == ddp["test_count"] == 64  # exact evaluation: every sample once
    assert hsdp["test_loss"] == pytest.approx(ddp["test_loss"], rel=1e-5)
    assert 0 < hsdp["state_bytes_per_rank"] <= 0.55 * ddp["state_bytes_per_rank"]


@pytest.mark.timeout(900)
def test_hsdp_checkpoint_resumes_as_fsdp_at_2_and_as_ddp_at_1(hsdp_whole, resumed):
    whole = load_weights(hsdp_whole)
    for run_dir in resumed.values():
        summary = _summary(run_dir)
        assert summary["resumed_from_step"] == 6 and summary["steps"] == 12
        assert max_relative_diff(load_weights(run_dir), whole) < 1e-5


@pytest.mark.timeout(900)
def test_plan_predicts_the_state_bytes_that_runs_measure(tmp_path, hsdp_whole, ddp_four, resumed):
    """The runs above and short ones of the remaining strategies and world sizes (ddp's state is the same at any
    world size: 1 and 4 stand for 2); distrib plan of the same config must give every figure exactly."""
    short = ("train.max_steps=1", "checkpoint.every_steps=0")
    measured = {("hsdp", 4): _summary(hsdp_whole), ("ddp", 4): _summary(ddp_four),
                ("fsdp", 2): _summary(resumed["fsdp"]), ("ddp", 1): _summary(resumed["ddp"]),
                ("hsdp", 2): _train(2, tmp_path / "hsdp2", "dist.strategy=hsdp", *short),
                ("fsdp", 4): _train(4, tmp_path / "fsdp4", "dist.strategy=fsdp", *short)}
    for strategy in ("fsdp", "hsdp"):
        measured[strategy, 1] = run_training(small_config(tmp_path / f"{strategy}1", *STEPS,
                                                          f"dist.strategy={strategy}", *short))
    for (strategy, world), summary in measured.items():
        assert summary["world_size"] == world
        extra = HSDP if (strategy, world) == ("hsdp", 4) else (f"dist.strategy={strategy}",)
        config = load_config(None, [*SMALL, *STEPS, f"run.dir={tmp_path}/plan", *extra])
        planned = plan_run(config, Machine(1, world))["state_bytes_per_rank"]
        assert planned == summary["state_bytes_per_rank"], (strategy, world)
    state = {key: summary["state_bytes_per_rank"] for key, summary in measured.items()}
    assert state["fsdp", 4] < state["fsdp", 2] < state["fsdp", 1] == state["ddp", 1] == state["ddp", 4]
