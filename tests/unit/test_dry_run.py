"""distrib plan --dry-run, in process: one rank's real layout on a fake process group of 4 ranks and a step on fake
tensors give a peak and its parts (fsdp; pp 2 x fsdp 2, the first and the last stage's ranks); a layout that cannot
be built is one line. (Its peak against real runs: tests/integration/test_meta_build.py.)"""

import json
import re

import pytest

from distrib.cli import main
from distrib.config import load_config
from distrib.errors import ConfigError
from distrib.plan import Machine
from distrib.plan.dry_run import PART_NAMES, dry_run, rows

TINY = ["model.name=gpt", "data.name=text", "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32",
        "dist.device=cpu", "model.kwargs={n_layers = 4, n_heads = 4, dim = 32, tie_weights = false}",
        "train.optimizer=adamw", "train.global_batch_size=16"]


def _sets(*overrides: str) -> list[str]:
    return [a for s in (*TINY, *overrides) for a in ("--set", s)]


def test_the_dry_run_of_fsdp_measures_a_peak_and_its_parts(capsys):
    assert main(["plan", *_sets("dist.strategy=fsdp"), "--world-size", "4", "--dry-run", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    parts = {part: figures[f"dry_run_{part}_bytes"] for part in PART_NAMES}
    assert figures["dry_run_peak_bytes_per_rank"] == sum(parts.values()) > 0
    assert [rank["rank"] for rank in figures["dry_run_ranks"]] == [0]
    # rank 0's shards of the parameters (and the buffers), and AdamW's two moments of them (and its step counts)
    assert figures["parameter_bytes_per_rank"] <= parts["parameters"] < 1.1 * figures["parameter_bytes_per_rank"]
    assert parts["optimizer"] >= 2 * figures["parameter_bytes_per_rank"]
    assert parts["activations"] > 0 and parts["ddp_buckets"] == 0
    assert figures["memory_bytes_per_rank"] > 0  # the analytic plan's, beside it


def test_the_dry_run_of_a_pipeline_measures_the_first_and_the_last_stage(capsys):
    assert main(["plan", *_sets("dist.strategy=fsdp", "dist.pipeline_parallel=2"), "--world-size", "4",
                 "--dry-run", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    lines = "\n".join(f"{name} {value}" for name, value in rows(figures))  # under the table without --json
    for text in ("dry run peak / rank", "rank 0 (pipeline rank 0)", "rank 2 (pipeline rank 1)"):
        assert text in lines, text
    ranks = figures["dry_run_ranks"]
    assert [(rank["rank"], rank["pipeline_rank"]) for rank in ranks] == [(0, 0), (2, 1)]
    assert figures["dry_run_peak_bytes_per_rank"] == max(rank["peak_bytes"] for rank in ranks) > 0
    # the first stage peaks in its backwards: its parameters gathered, its microbatches' activations in flight
    assert ranks[0]["parts"]["unsharded_parameters"] > 0 and ranks[0]["parts"]["activations"] > 0
    assert all(rank["parts"]["optimizer"] > 0 for rank in ranks)


@pytest.mark.parametrize("overrides, message", [
    (["dist.strategy=fsdp", "dist.tensor_parallel=3"], "dist.tensor_parallel = 3: does not divide world size 4"),
    (["dist.strategy=fsdp", "dist.pipeline_parallel=4", "model.kwargs={n_layers = 2, n_heads = 4, dim = 32}"],
     "dist.pipeline_parallel = 4 x 1 stage(s) per rank = 4 stages: more than GPT's 2 blocks"),
])
def test_a_layout_that_cannot_be_built_is_one_line(overrides, message, capsys):
    with pytest.raises(ConfigError, match=re.escape(message)):
        dry_run(load_config(None, [*TINY, *overrides]), Machine(1, 4))
    assert main(["plan", *_sets(*overrides), "--world-size", "4", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("overrides, by_part", [
    (["dist.strategy=fsdp", "speed.activation_checkpointing=blocks"], True),
    (["dist.strategy=fsdp", "dist.pipeline_parallel=2"], True),
    (["dist.strategy=fsdp", "dist.pipeline_parallel=2", "data.seq_len=8", "train.global_batch_size=4"], False)])
def test_a_rank_of_many_blocks_is_stepped_with_two_and_three_and_counted(overrides, by_part):
    """8 alike blocks a rank (4 a stage under pp 2): stepped cut to 2 and 3 a stage, the line through the two peaks
    extended to the rank's blocks, part by part, against the whole model stepped. With windows of 8 the last stage
    peaks at another turn of its step at 2 and 3 blocks than at 4 (its peak's line alone read 1.8% low): each turn's
    line is extended and the highest taken (two turns within 1% of each other there, so their parts differ)."""
    config = load_config(None, [*TINY, "model.kwargs={n_layers = 8, n_heads = 4, dim = 32, tie_weights = false}",
                                *overrides])
    whole, counted = dry_run(config, Machine(1, 4), every_block=True), dry_run(config, Machine(1, 4))
    per_rank = 8 // config.dist.pipeline_parallel
    assert [(r.get("measured_blocks"), r.get("blocks")) for r in counted["dry_run_ranks"]] == \
        [((2, 3), per_rank)] * len(counted["dry_run_ranks"])
    assert all("blocks" not in r for r in whole["dry_run_ranks"])
    for ours, reference in zip(counted["dry_run_ranks"], whole["dry_run_ranks"]):
        assert ours["peak_bytes"] == pytest.approx(reference["peak_bytes"], rel=0.01)
        for part in ("parameters", "gradients", "optimizer", "activations") if by_part else ():
            assert ours["parts"][part] == pytest.approx(reference["parts"][part], rel=0.01, abs=1024), part


def test_a_cuda_target_is_measured_with_the_fused_kernel_and_given_the_plans_verdict(capsys):
    """dist.device = cuda: attention as the fused kernels hold it (distrib.plan.attention), and the plan's verdict of
    the measured peak: DOES NOT FIT on a 1 MiB device, with the plan's fixes, each lower than the peak."""
    assert main(["plan", *_sets("dist.strategy=fsdp", "dist.device=cuda"), "--world-size", "4", "--dry-run", "--json",
                 "--device-memory", str(1 / 1024)]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["dry_run_attention"] == "fused" and figures["dry_run_fits"] is False
    # on an accelerator FSDP prefetches a block beyond what the CPU mesh measures
    assert figures["dry_run_memory_bytes_per_rank"] >= figures["dry_run_peak_bytes_per_rank"] + \
        figures["dry_run_prefetched_bytes"] > figures["dry_run_peak_bytes_per_rank"]
    assert figures["dry_run_fixes"] and all(fix["memory_bytes_per_rank"] < figures["dry_run_memory_bytes_per_rank"]
                                            for fix in figures["dry_run_fixes"])
    lines = "\n".join(f"{name} {value}" for name, value in rows(figures))
    assert "dry run device memory DOES NOT FIT" in lines
    assert "dry run fixes --" in lines and "--set speed.activation_checkpointing=blocks: " in lines
    assert "(fused attention, 2 and 3 blocks stepped and the rank's 4 counted)" in lines


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_dry_run_of_experts_under_activation_checkpointing_recomputes_the_routing_it_ran(precision):
    """A block's recomputation saves what its forward saved (checkpointing compares them): the experts' grouped matmul
    and their counts take the same shape-only path in both (the matrix's MoE row failed at bincount, then at
    grouped_mm's stand-in seen by the forward only)."""
    config = load_config(None, [*TINY, "model.kwargs={n_layers = 4, n_heads = 4, dim = 32, tie_weights = false, "
                                "n_experts = 8, top_k = 2, expert_hidden_dim = 32}", "dist.strategy=fsdp",
                                "dist.expert_parallel=2", "speed.activation_checkpointing=blocks",
                                f"train.precision={precision}"])
    figures = dry_run(config, Machine(1, 4), every_block=True)
    assert figures["dry_run_peak_bytes_per_rank"] > 0 and figures["dry_run_activations_bytes"] > 0
