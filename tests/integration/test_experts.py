"""A user's mixture of experts with an expert that gets no token in some steps and an aux loss returned in a dict
(tests/helpers/moe.py): world 1 with 2 micro-batches, world 2 ddp and world 2 fsdp end on the same weights, log the
same aux loss at every step, and ddp with dist.find_unused_parameters = false stops with one line naming the key. The
world-size-2 runs share one launch (tests/helpers/train_runs.py)."""

import json
import sys

import pytest
from safetensors.torch import load_file

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import launch_runs, split_runs
from tests.helpers.support import max_relative_diff

MOE = ["data.factory=tests.helpers.moe:tokens", "model.factory=tests.helpers.moe:moe_lm", "train.max_steps=8",
       "train.epochs=0", "train.global_batch_size=16", "train.optimizer=adamw", "train.lr=0.01",
       "train.weight_decay=0.1", "train.warmup_steps=2", "train.log_every=1", "run.progress=false", "dist.device=cpu",
       "checkpoint.every_steps=0"]
RUNS = {"ddp": [], "fsdp": ["dist.strategy=fsdp"], "ddp_false": ["dist.find_unused_parameters=false"]}


def _weights(run_dir) -> dict:
    return {name: tensor for path in sorted((run_dir / "weights").glob("*.safetensors"))
            for name, tensor in load_file(path).items()}


def _aux_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["aux_loss"] for record in records if "aux_loss" in record}


@pytest.mark.timeout(900)
def test_a_moe_with_a_dead_expert_agrees_at_world_sizes_1_and_2_under_ddp_and_fsdp(tmp_path):
    run_training(load_config(None, [*MOE, "train.grad_accum_steps=2", f"run.dir={tmp_path / 'one'}"]))
    runs = [(name, {}, [*MOE, *overrides, f"run.dir={tmp_path / name}"]) for name, overrides in RUNS.items()]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = launch_runs(launcher, runs, tmp_path, codes=tmp_path / "codes.json")
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads((tmp_path / "codes.json").read_text()) == {"ddp": 0, "fsdp": 0, "ddp_false": 2}
    said = split_runs(result.stderr, list(RUNS))

    one = tmp_path / "one"
    flops = {name: json.loads((tmp_path / name / "summary.json").read_text())["flops_per_sample"]
             for name in ("one", "ddp", "fsdp")}
    assert flops["one"] > 0 and len(set(flops.values())) == 1, flops  # the whole model's top-1, not fsdp's shard
    for name in ("ddp", "fsdp"):
        assert max_relative_diff(_weights(tmp_path / name), _weights(one)) < 1e-5, name
        aux = _aux_losses(tmp_path / name)
        assert list(aux) == list(range(1, 9)), name  # logged at every step
        assert aux == pytest.approx(_aux_losses(one), rel=1e-5), name
    assert "dist.find_unused_parameters = auto: on, since the model has experts" in said["ddp"]
    assert "training loss = cross_entropy + aux_loss" in said["fsdp"]
    assert "Traceback" not in said["fsdp"] and "doesn't match" not in said["fsdp"]
    errors = [line for line in said["ddp_false"].splitlines() if line.startswith("distrib: error:")]
    assert errors and all(line.endswith("fix: --set dist.find_unused_parameters=true") for line in errors), errors
    assert "Traceback" not in said["ddp_false"]
