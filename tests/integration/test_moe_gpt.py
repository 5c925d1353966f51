"""The built-in GPT as a mixture of experts (4 blocks, 8 experts, top-2, an aux loss, DeepSeek-V3's bias balancing)
after 12 AdamW steps under each layout of RUNS, in one launch of 4 workers, against one process with as many
accumulation steps as a run has micro-batches per step (its data ranks x its pipeline microbatches): the weights and
the expert bias within 1e-5, and the logged aux_loss, expert_imbalance and dropped_tokens of every step the same.

A layout is one line of RUNS (expert parallel adds its own)."""

import json
from pathlib import Path

import pytest
import torch

from distrib.config import load_config
from distrib.plan import Machine, plan_run
from distrib.worker import run_training
from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.support import assert_ok, load_weights, max_relative_diff

TEXT = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files ships it: 35 kB of English prose
MOE = ["model.name=gpt", "model.kwargs={n_layers = 4, n_heads = 4, dim = 64, tie_weights = false, n_experts = 8, "
       "top_k = 2, expert_hidden_dim = 64, aux_loss_coef = 0.01, bias_update_rate = 0.001}",
       "data.name=text", f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw", "train.lr=3e-3",
       "train.warmup_steps=3", "train.max_steps=12", "train.global_batch_size=16", "train.epochs=0",
       "train.eval_every_epochs=0", "train.log_every=1", "checkpoint.every_steps=0", "run.progress=false",
       "dist.device=cpu"]
# Each run: 4 micro-batches of 4 samples per step (fsdp 4: 4 data ranks; pp 2 x fsdp 2: 2 data ranks x 2 microbatches).
RUNS = {"fsdp4": ["dist.strategy=fsdp"],
        "pp2_fsdp2": ["dist.strategy=fsdp", "dist.pipeline_parallel=2"]}
FIGURES = ("aux_loss", "expert_imbalance", "dropped_tokens")
# Expert parallel (dist.expert_parallel), in the same launch, its gradient norm clipped (at 0.5: it is 1.5-2.0 in
# these steps), so that the clip spans the dense and the expert meshes: against one process clipped alike. The ep 2 x
# fsdp 2 run's checkpoint at step 6 is resumed as it was, as fsdp 4 and (in process) as one process. A token whose
# top-k scores tie within float noise may go to another expert under another layout (one token's output, then the
# weights, 1e-4 apart): measured, none at this clip; at 1.0 one in step 12 of the runs of 2 data ranks, at 1.5 one in
# ep 2 x fsdp 2's.
CLIPPED = ["dist.strategy=fsdp", "train.grad_clip=0.5"]
RESUME = "checkpoint.resume={tmp}/ep2_fsdp2/checkpoints/step_00000006"
EXPERT_RUNS = {"ep2_fsdp2": [*CLIPPED, "dist.expert_parallel=2", "checkpoint.every_steps=6"],
               "ep4": [*CLIPPED, "dist.expert_parallel=4"],
               "ep2_tp2": [*CLIPPED, "dist.expert_parallel=2", "dist.tensor_parallel=2", "train.grad_accum_steps=2"],
               "pp2_ep2": [*CLIPPED, "dist.expert_parallel=2", "dist.pipeline_parallel=2"],
               "ep2_resumed": [*CLIPPED, "dist.expert_parallel=2", RESUME],
               "fsdp4_resumed": [*CLIPPED, RESUME]}


def _figures(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {name: r[name] for name in (*FIGURES, "loss")} for r in records if "expert_imbalance" in r}


@pytest.mark.timeout(900)
def test_the_moe_gpt_trains_as_one_process_under_each_layout(tmp_path):
    run_training(load_config(None, [*MOE, "train.grad_accum_steps=4", f"run.dir={tmp_path / 'one'}"]))
    launched = {**RUNS, **{name: [item.format(tmp=tmp_path) for item in sets] for name, sets in EXPERT_RUNS.items()}}
    result = torchrun_runs(4, {name: [*MOE, *sets, f"run.dir={tmp_path / name}"] for name, sets in launched.items()},
                           tmp_path)
    assert_ok(result)
    said = split_runs(result.stderr, list(launched))
    reference, figures = load_weights(tmp_path / "one"), _figures(tmp_path / "one")
    assert list(figures) == list(range(1, 13)) and all(f["dropped_tokens"] == 0 for f in figures.values())
    assert any(tensor.abs().sum() > 0 for name, tensor in reference.items() if name.endswith("expert_bias"))
    for name in RUNS:
        weights = load_weights(tmp_path / name)
        diff = max_relative_diff(weights, reference)
        print(f"{name}: max relative difference of the weights to one process {diff:.3g}")
        assert diff < 1e-5, name
        logged = _figures(tmp_path / name)
        assert logged.keys() == figures.keys(), name
        for step, values in logged.items():
            # the logged loss: cross-entropy + aux_loss, but under pipeline parallel the last stage's cross-entropy
            loss = values.pop("loss") + (values["aux_loss"] if "pp" in name else 0)
            assert loss == pytest.approx(figures[step]["loss"], rel=1e-5), (name, step)
            assert values == pytest.approx({k: figures[step][k] for k in FIGURES}, rel=1e-5), (name, step)
        assert "Traceback" not in said[name], name
    _expert_parallel_as_one_process(tmp_path, said)


def _expert_parallel_as_one_process(tmp_path: Path, said: dict[str, str]) -> None:
    """EXPERT_RUNS against one process clipped alike (the resumed ones against the run they resume too), and plan's
    bytes against the runs'."""
    one = [*MOE, *CLIPPED[1:], "train.grad_accum_steps=4"]
    run_training(load_config(None, [*one, f"run.dir={tmp_path / 'one_clipped'}"]))
    resume = RESUME.format(tmp=tmp_path)
    resumed = run_training(load_config(None, [*one, resume, f"run.dir={tmp_path / 'one_resumed'}"]))
    assert resumed["resumed_from_step"] == 6
    reference, figures = load_weights(tmp_path / "one_clipped"), _figures(tmp_path / "one_clipped")
    for name in [*EXPERT_RUNS, "one_resumed"]:
        diff = max_relative_diff(load_weights(tmp_path / name), reference)
        print(f"{name}: max relative difference of the weights to one process {diff:.3g}")
        assert diff < 1e-5, name
        for step, values in _figures(tmp_path / name).items():
            values["loss"] += values["aux_loss"] if "pp" in name else 0  # the last stage's cross-entropy alone
            assert values == pytest.approx(figures[step], rel=1e-5), (name, step)
        # (and not torch's warning that gathering the experts whole takes two all-gathers: expert_parallel quiets it)
        assert name == "one_resumed" or ("Traceback" not in said[name] and "_StridedShard" not in said[name]), name
    as_it_was, again = load_weights(tmp_path / "ep2_fsdp2"), load_weights(tmp_path / "ep2_resumed")
    assert all(torch.equal(again[key], tensor) for key, tensor in as_it_was.items())  # bitwise
    for name in ("fsdp4_resumed", "one_resumed"):
        diff = max_relative_diff(load_weights(tmp_path / name), as_it_was)
        print(f"{name}: max relative difference of the weights to the run it resumed {diff:.3g}")
        assert diff < 1e-5, name
    for name, layout in (("ep2_fsdp2", ["dist.expert_parallel=2"]), ("pp2_ep2", EXPERT_RUNS["pp2_ep2"])):
        planned = plan_run(load_config(None, [*MOE, *CLIPPED, *layout, f"run.dir={tmp_path}/p"]), Machine(1, 4))
        assert planned["state_bytes_per_rank"] == json.loads((tmp_path / name / "summary.json").read_text())[
            "state_bytes_per_rank"], name
    # pp 2 x ep 2: each rank 2 of the 4 layers (its stage's), half of each one's 8 experts (nothing left of its shard
    # group of 2 to shard them over)
    assert planned["expert_parameter_bytes_per_rank"] == 2 * 3 * 4 * 64 * 64 * 4
