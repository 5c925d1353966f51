"""Mixtures of experts against one process with as many accumulation steps as a run has micro-batches per step (its
data ranks x its pipeline microbatches), in one launch of 4 workers.

The built-in GPT as a mixture of experts (4 blocks, 8 experts, top-2, an aux loss, DeepSeek-V3's bias balancing)
after 6 AdamW steps under each layout of EXPERT_RUNS: the weights and the expert bias within 1e-5, and the logged
loss, aux_loss, expert_imbalance and dropped_tokens of every step the same. A layout is one line of EXPERT_RUNS. Among
them ep 2 x cp 2 (each rank a cut of every window; the aux loss's expert shares summed over the cp group: without the
sum, measured, the weights end 0.45 from one process's, max relative), resumed from its step 3 bitwise.

Hugging Face mixtures of experts from local safetensors in the Hub's layout (tests/helpers/pretrained.py: a tiny
Mixtral and Qwen3-MoE, 4 experts, top 2, the router's aux loss in outputs.loss), read by model.init_from through
transformers' own conversion into their fused experts: the Mixtral under expert parallel 2 x fsdp 2 (its experts
through distrib's all-to-all dispatch) and the Qwen3-MoE under hsdp 2 x 2 (its fused experts sharded over 2 ranks
without expert parallel) end 6 AdamW steps within 1e-5 of one process, log its aux loss, its expert_imbalance and
dropped_tokens (counted from the router's choices) and the layout of its experts, plan their state bytes, and their
weights/ load with from_pretrained and give one process's logits. (Names, the experts each rank reads, the dispatch on
one rank, refusals, the load counted: tests/unit/test_hf_moe.py.)"""

import json
from pathlib import Path

import pytest
import torch

from distrib.config import load_config
from distrib.plan import Machine, plan_run
from distrib.worker import run_training
from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.pretrained import moe_from_pretrained, save_moe
from tests.helpers.support import assert_ok, load_weights, max_relative_diff

TEXT = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files ships it: 35 kB of English prose
MOE = ["model.name=gpt", "model.kwargs={n_layers = 4, n_heads = 4, dim = 64, tie_weights = false, n_experts = 8, "
       "top_k = 2, expert_hidden_dim = 64, aux_loss_coef = 0.01, bias_update_rate = 0.001}",
       "data.name=text", f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw", "train.lr=3e-3",
       "train.warmup_steps=3", "train.max_steps=6", "train.global_batch_size=16", "train.epochs=0",
       "train.eval_every_epochs=0", "train.log_every=1", "checkpoint.every_steps=0", "run.progress=false",
       "dist.device=cpu"]
FIGURES = ("aux_loss", "expert_imbalance", "dropped_tokens")
# Each run: 4 micro-batches of 4 samples per step (fsdp 4: 4 data ranks; pp 2 x ep 2: 2 data ranks x 2 microbatches).
# Its gradient norm clipped (at 0.5: it is 1.5-2.0 in these steps), so that under expert parallel the clip spans the
# dense and the expert meshes: against one process clipped alike. The ep 2 x fsdp 2 run's checkpoint at step 3 is
# resumed as it was, as fsdp 4 (the MoE's experts sharded by fsdp alone) and (in process) as one process. A token
# whose top-k scores tie within float noise may go to another expert under another layout (one token's output, then
# the weights, 1e-4 apart): measured over 12 steps, none at this clip; at 1.0 one in step 12 of the runs of 2 data
# ranks, at 1.5 one in ep 2 x fsdp 2's.
CLIPPED = ["dist.strategy=fsdp", "train.grad_clip=0.5"]
RESUME = "checkpoint.resume={tmp}/ep2_fsdp2/checkpoints/step_00000003"
# 2 data ranks x 2 accumulation steps: the 4 micro-batches of 4 windows whose aux losses one process averages
EP2_CP2 = [*CLIPPED, "dist.expert_parallel=2", "dist.context_parallel=2", "train.grad_accum_steps=2"]
EXPERT_RUNS = {"ep2_fsdp2": [*CLIPPED, "dist.expert_parallel=2", "checkpoint.every_steps=3"],
               "ep4": [*CLIPPED, "dist.expert_parallel=4"],
               "ep2_tp2": [*CLIPPED, "dist.expert_parallel=2", "dist.tensor_parallel=2", "train.grad_accum_steps=2"],
               "pp2_ep2": [*CLIPPED, "dist.expert_parallel=2", "dist.pipeline_parallel=2"],
               "ep2_resumed": [*CLIPPED, "dist.expert_parallel=2", RESUME],
               "fsdp4_resumed": [*CLIPPED, RESUME],
               "ep2_cp2": [*EP2_CP2, "checkpoint.every_steps=3"],
               "ep2_cp2_resumed": [*EP2_CP2, "checkpoint.resume={tmp}/ep2_cp2/checkpoints/step_00000003"]}
HF = ["data.factory=tests.helpers.pretrained:token_dicts", "train.max_steps=6", "train.epochs=0",
      "train.global_batch_size=16", "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=2",
      "train.log_every=1", "run.progress=false", "dist.device=cpu", "checkpoint.every_steps=0"]
# run name: (family, layout at world size 4); first in the launch, expert parallel first (a run of another ep layout
# before it in the same workers would hand it a stale process group)
HF_RUNS = {"mixtral_ep2_fsdp2": ("mixtral", ["dist.strategy=fsdp", "dist.expert_parallel=2"]),
           "qwen3_moe_hsdp": ("qwen3_moe", ["dist.strategy=hsdp", "dist.shard_size=2"])}
# each run's start-up line on its experts' layout
HF_LAYOUTS = {"mixtral_ep2_fsdp2": "experts: 2 MoE layers of 4 experts (top 2); expert parallel 2 x fsdp 2: 2 of 4 "
                                   "experts per rank",
              "qwen3_moe_hsdp": "experts: 2 MoE layers of 4 experts (top 2); no expert parallel (fsdp 2 shards them): "
                                "4 of 4 experts per rank"}


def _figures(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {name: r[name] for name in (*FIGURES, "loss")} for r in records if "expert_imbalance" in r}


def _family(tmp: Path, family: str) -> list[str]:
    """The family's run as users write it: a factory taking only the folder (which distrib train's check before
    any worker builds: tests/unit/test_expert_parallel.py), its weights from model.init_from."""
    return [*HF, "model.factory=tests.helpers.pretrained:moe_from_config",
            f'model.kwargs={{folder = "{tmp / family}"}}', f"model.init_from={tmp / family}"]


# LoRA on the Qwen3-MoE's attention and on its fused experts (peft's ParamWrapper: an A and a B per expert), under
# expert parallel 2 x fsdp 2: first in the launch, as the ep runs are
LORA_RUN = "qwen3_moe_lora_ep2_fsdp2"


def _lora(tmp: Path) -> list[str]:
    return [*_family(tmp, "qwen3_moe"), "model.factory=tests.helpers.pretrained:lora_moe",
            f'model.kwargs={{folder = "{tmp / "qwen3_moe"}", targets = "q_proj,gate_proj,up_proj,down_proj"}}']


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The Hugging Face folders and each family's one process (4 accumulation steps: the launch's 4 data ranks), then
    the launch of HF_RUNS and EXPERT_RUNS. Returns the folder and each launched run's part of rank 0's stderr."""
    tmp = tmp_path_factory.mktemp("moe")
    for family in ("mixtral", "qwen3_moe"):
        save_moe(tmp / family, family)
        run_training(load_config(None, [*_family(tmp, family), "train.grad_accum_steps=4",
                                        f"run.dir={tmp / f'{family}_one'}"]))
    run_training(load_config(None, [*_lora(tmp), "train.grad_accum_steps=4", f"run.dir={tmp / 'lora_one'}"]))
    runs = {LORA_RUN: [*_lora(tmp), "dist.strategy=fsdp", "dist.expert_parallel=2"],
            **{name: [*_family(tmp, family), *layout] for name, (family, layout) in HF_RUNS.items()},
            **{name: [*MOE, *[item.format(tmp=tmp) for item in sets]] for name, sets in EXPERT_RUNS.items()}}
    (tmp / "launch").mkdir()
    result = torchrun_runs(4, {name: [*items, f"run.dir={tmp / name}"] for name, items in runs.items()},
                           tmp / "launch")
    assert_ok(result)
    return tmp, split_runs(result.stderr, list(runs))


@pytest.mark.timeout(900)
def test_the_moe_gpt_trains_as_one_process_under_each_layout(launched):
    """EXPERT_RUNS against one process clipped alike (the resumed ones against the run they resume too), and plan's
    bytes against the runs'."""
    tmp_path, said = launched
    one = [*MOE, *CLIPPED[1:], "train.grad_accum_steps=4"]
    run_training(load_config(None, [*one, f"run.dir={tmp_path / 'one_clipped'}"]))
    resume = RESUME.format(tmp=tmp_path)
    resumed = run_training(load_config(None, [*one, resume, f"run.dir={tmp_path / 'one_resumed'}"]))
    assert resumed["resumed_from_step"] == 3
    reference, figures = load_weights(tmp_path / "one_clipped"), _figures(tmp_path / "one_clipped")
    assert list(figures) == list(range(1, 7)) and all(f["dropped_tokens"] == 0 for f in figures.values())
    assert any(tensor.abs().sum() > 0 for name, tensor in reference.items() if name.endswith("expert_bias"))
    for name in [*EXPERT_RUNS, "one_resumed"]:
        diff = max_relative_diff(load_weights(tmp_path / name), reference)
        print(f"{name}: max relative difference of the weights to one process {diff:.3g}")
        assert diff < 1e-5, name
        logged = _figures(tmp_path / name)
        assert list(logged) == list(range(4 if "resumed" in name else 1, 7)), name  # every step it trained
        for step, values in logged.items():
            values["loss"] += values["aux_loss"] if "pp" in name else 0  # the last stage's cross-entropy alone
            assert values == pytest.approx(figures[step], rel=1e-5), (name, step)
        # (and not torch's warning that gathering the experts whole takes two all-gathers: expert_parallel quiets it)
        assert name == "one_resumed" or ("Traceback" not in said[name] and "_StridedShard" not in said[name]), name
    for went_on, resumed in (("ep2_fsdp2", "ep2_resumed"), ("ep2_cp2", "ep2_cp2_resumed")):
        again = load_weights(tmp_path / resumed)
        assert all(torch.equal(again[key], tensor) for key, tensor in load_weights(tmp_path / went_on).items())
    assert "fsdp: shard 2 (ep 2) x cp 2" in said["ep2_cp2"] and "expert parallel 2 x fsdp 2" in said["ep2_cp2"]
    as_it_was = load_weights(tmp_path / "ep2_fsdp2")
    for name in ("fsdp4_resumed", "one_resumed"):
        diff = max_relative_diff(load_weights(tmp_path / name), as_it_was)
        print(f"{name}: max relative difference of the weights to the run it resumed {diff:.3g}")
        assert diff < 1e-5, name
    for name, layout in (("ep2_fsdp2", ["dist.expert_parallel=2"]), ("ep2_cp2", EP2_CP2),
                         ("pp2_ep2", EXPERT_RUNS["pp2_ep2"])):
        planned = plan_run(load_config(None, [*MOE, *CLIPPED, *layout, f"run.dir={tmp_path}/p"]), Machine(1, 4))
        assert planned["state_bytes_per_rank"] == json.loads((tmp_path / name / "summary.json").read_text())[
            "state_bytes_per_rank"], name
    # pp 2 x ep 2: each rank 2 of the 4 layers (its stage's), half of each one's 8 experts (nothing left of its shard
    # group of 2 to shard them over)
    assert planned["expert_parameter_bytes_per_rank"] == 2 * 3 * 4 * 64 * 64 * 4


def _aux_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["aux_loss"] for record in records if "aux_loss" in record]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(HF_RUNS))
def test_a_hub_layout_mixture_of_experts_trains_sharded_like_one_process(launched, name):
    tmp, logs = launched
    family = HF_RUNS[name][0]
    one = load_weights(tmp / f"{family}_one")
    assert max_relative_diff(one, moe_from_pretrained(str(tmp / family)).state_dict()) > 1e-2  # the steps moved it
    assert max_relative_diff(load_weights(tmp / name), one) < 1e-5
    assert "through transformers' checkpoint conversion" in logs[name] and "no rank held the model whole" in logs[name]
    # no rank says torch's warning that gathering the experts whole for weights/ takes two all-gathers (expert_parallel
    # quiets it for transformers' experts too), nor FSDP2's that a unit returned a view
    assert "_StridedShard" not in logs[name] and "view tensor" not in logs[name]
    aux, aux_one = _aux_losses(tmp / name), _aux_losses(tmp / f"{family}_one")
    assert len(aux) == 6 and aux == pytest.approx(aux_one, rel=1e-5)  # logged once per step, not added to the loss
    # the expert load from the router's choices, as the built-in GPT's: the same every step as one process's
    load, load_one = _figures(tmp / name), _figures(tmp / f"{family}_one")
    assert list(load) == list(range(1, 7)) and all(f["dropped_tokens"] == 0 for f in load.values())
    assert all(f["expert_imbalance"] > 1 for f in load.values())
    for step, figures in load.items():
        assert figures == pytest.approx(load_one[step], rel=1e-5), step
    assert HF_LAYOUTS[name] in logs[name] and "expert_imbalance" in logs[name]
    planned = plan_run(load_config(None, [*_family(tmp, family), *HF_RUNS[name][1], f"run.dir={tmp}/p"]),
                       Machine(1, 4))
    assert planned["moe_layers_per_rank"] == 2 and planned["expert_parameter_bytes_per_rank"] > 0
    assert planned["state_bytes_per_rank"] == json.loads((tmp / name / "summary.json").read_text())[
        "state_bytes_per_rank"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(HF_RUNS))
def test_its_weights_keep_the_models_names_and_give_one_process_logits_through_from_pretrained(launched, name):
    tmp, _ = launched
    family = HF_RUNS[name][0]
    loaded = moe_from_pretrained(str(tmp / name / "weights")).eval()
    assert any(".mlp.experts.gate_up_proj" in key for key in loaded.state_dict())
    one = moe_from_pretrained(str(tmp / f"{family}_one" / "weights")).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, reference = loaded(ids).logits, one(ids).logits
    assert ((logits - reference).norm() / reference.norm()).item() < 1e-5


@pytest.mark.timeout(900)
def test_lora_on_the_experts_splits_with_them_and_trains_like_one_process(launched):
    """Under expert parallel each rank adds to its experts the delta of their rows of each A and B (not split by
    expert: fsdp shards them as dense parameters): the wrapped model (adapter included) within 1e-5 of one process
    after 6 steps, and its weights/merged/ (each rank its experts' delta) that of one process."""
    tmp, _ = launched
    one = load_weights(tmp / "lora_one")
    assert all(tensor.abs().sum() > 0 for name, tensor in one.items() if ".experts." in name and "lora_B" in name)
    assert max_relative_diff(load_weights(tmp / LORA_RUN), one) < 1e-5
    merged = moe_from_pretrained(str(tmp / LORA_RUN / "weights" / "merged")).state_dict()
    assert max_relative_diff(merged, moe_from_pretrained(str(tmp / "lora_one" / "weights" / "merged")).state_dict()) \
        < 1e-5
