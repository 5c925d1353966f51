"""Hugging Face mixtures of experts from local safetensors in the Hub's layout (tests/helpers/pretrained.py: a tiny
Mixtral and Qwen3-MoE, 4 experts, top 2, the router's aux loss in outputs.loss), read by model.init_from through
transformers' own conversion into their fused experts: the Mixtral under expert parallel 2 x fsdp 2 (its experts
through distrib's all-to-all dispatch) and under fsdp (4 shards, one expert each), and the Qwen3-MoE under hsdp 2 x 2,
in one launch of 4 workers, end 12 AdamW steps within 1e-5 of one process with 4 accumulation steps, log its aux
loss, and their weights/ load with from_pretrained and give one process's logits. (Names, the experts each rank
reads, the dispatch on one rank, refusals: tests/unit/test_hf_moe.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.pretrained import moe_from_pretrained, save_moe
from tests.helpers.support import assert_ok, load_weights, max_relative_diff

COMMON = ["data.factory=tests.helpers.pretrained:token_dicts", "train.max_steps=12", "train.epochs=0",
          "train.global_batch_size=16", "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=2",
          "train.log_every=1", "run.progress=false", "dist.device=cpu", "checkpoint.every_steps=0"]
# run name: (family, layout at world size 4); expert parallel first (a run of another ep layout before it in the
# same workers would hand it a stale process group)
RUNS = {"mixtral_ep2_fsdp2": ("mixtral", ["dist.strategy=fsdp", "dist.expert_parallel=2"]),
        "mixtral_fsdp": ("mixtral", ["dist.strategy=fsdp"]),
        "qwen3_moe_hsdp": ("qwen3_moe", ["dist.strategy=hsdp", "dist.shard_size=2"])}


def _family(tmp: Path, family: str) -> list[str]:
    return [*COMMON, f"model.factory=tests.helpers.pretrained:{family}", f"model.init_from={tmp / family}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The saved folders, each family's one process (4 accumulation steps: the launch's 4 data ranks), then the
    launch. Returns the folder and each launched run's part of rank 0's stderr."""
    tmp = tmp_path_factory.mktemp("hf_moe")
    for family in ("mixtral", "qwen3_moe"):
        save_moe(tmp / family, family)
        run_training(load_config(None, [*_family(tmp, family), "train.grad_accum_steps=4",
                                        f"run.dir={tmp / f'{family}_one'}"]))
    (tmp / "launch").mkdir()
    done = torchrun_runs(4, {name: [*_family(tmp, family), *layout, f"run.dir={tmp / name}"]
                             for name, (family, layout) in RUNS.items()}, tmp / "launch")
    assert_ok(done)
    return tmp, split_runs(done.stderr, list(RUNS))


def _aux_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["aux_loss"] for record in records if "aux_loss" in record]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RUNS))
def test_a_hub_layout_mixture_of_experts_trains_sharded_like_one_process(runs, name):
    tmp, logs = runs
    family = RUNS[name][0]
    one = load_weights(tmp / f"{family}_one")
    assert max_relative_diff(one, moe_from_pretrained(str(tmp / family)).state_dict()) > 1e-2  # the steps moved it
    assert max_relative_diff(load_weights(tmp / name), one) < 1e-5
    assert "through transformers' checkpoint conversion" in logs[name] and "no rank held the model whole" in logs[name]
    aux, aux_one = _aux_losses(tmp / name), _aux_losses(tmp / f"{family}_one")
    assert len(aux) == 12 and aux == pytest.approx(aux_one, rel=1e-5)  # logged once per step, not added to the loss


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RUNS))
def test_its_weights_keep_the_models_names_and_give_one_process_logits_through_from_pretrained(runs, name):
    tmp, _ = runs
    family = RUNS[name][0]
    loaded = moe_from_pretrained(str(tmp / name / "weights")).eval()
    assert any(".mlp.experts.gate_up_proj" in key for key in loaded.state_dict())
    one = moe_from_pretrained(str(tmp / f"{family}_one" / "weights")).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, reference = loaded(ids).logits, one(ids).logits
    assert ((logits - reference).norm() / reference.norm()).item() < 1e-5
