"""distrib plan under context parallel, in process (a fake group of 4 ranks): cp 2 x fsdp 2 names its layout,
counts the keys' and values' all-gather and the reduce-scatter of their gradients over the cp ranks (a rank's own
keys and values a collective, again for the all-gather where blocks are recomputed), FSDP2's traffic over the shard
and cp ranks together, and a rank's activations: a half of each sequence's, the gathered keys and values and the
attention's additive mask, one a micro-batch (its layers share it). (Against a real run's: scripts/bench_cp.py, in
tests/integration/test_bench.py.)"""

import pytest

from distrib.config import load_config
from distrib.plan import Machine, plan_run

LAYERS, DIM, SEQ = 2, 32, 256
GPT = ["model.name=gpt", f"model.kwargs={{n_layers = {LAYERS}, n_heads = 4, dim = {DIM}}}", "data.name=text",
       "data.root=/usr/share/common-licenses/GPL-3", f"data.seq_len={SEQ}", "train.optimizer=adamw",
       "dist.device=cpu", "dist.strategy=fsdp"]


def _plan(*overrides: str) -> dict:
    return plan_run(load_config(None, [*GPT, *overrides]), Machine(1, 4))


def _by(figures: dict, dimension: str) -> dict[str, float]:
    return {c["kind"]: c["intra_node"] + c["inter_node"] for c in figures["collectives"]
            if c["dimension"] == dimension}


@pytest.fixture(scope="module")
def plans() -> dict[str, dict]:
    # one window a rank's micro-batch in both: the cp ranks read the same one
    return {"cp1": _plan("train.global_batch_size=4"),
            "cp2": _plan("train.global_batch_size=2", "dist.context_parallel=2"),
            "cp2_recomputed": _plan("train.global_batch_size=2", "dist.context_parallel=2",
                                    "speed.activation_checkpointing=blocks")}


def test_the_plan_counts_the_gathered_keys_and_values_and_fsdp_over_shard_and_cp(plans):
    one, two = plans["cp1"], plans["cp2"]
    assert two["mesh"] == {"shard": 2, "cp": 2} and two["micro_batch_size"] == one["micro_batch_size"] == 1
    own = LAYERS * 2 * (SEQ // 2) * DIM * 4  # each layer's K and V of a rank's half of the window, fp32
    assert _by(two, "cp") == {"all-gather": own, "reduce-scatter": own}  # (C - 1) x its own, C = 2
    assert _by(plans["cp2_recomputed"], "cp") == {"all-gather": 2 * own, "reduce-scatter": own}
    assert _by(one, "cp") == {}
    # FSDP2 shards over the 4 ranks of shard x cp: the same shards and gathers as fsdp 4's
    assert _by(two, "shard_cp") == _by(one, "shard") != {}
    assert two["state_bytes_per_rank"] == one["state_bytes_per_rank"]


def test_a_cp_rank_keeps_half_a_sequence_and_the_gathered_keys_values_and_mask(plans):
    one, two = plans["cp1"]["activation_bytes_per_micro_batch"], plans["cp2"]["activation_bytes_per_micro_batch"]
    gathered = LAYERS * 2 * SEQ * DIM * 4  # each layer's K and V of the whole window
    mask = (SEQ // 2) * SEQ * 4  # the additive float mask the layers share (MaskedAttention), counted once
    assert one / 2 < two <= one / 2 + gathered + mask
    assert two - one / 2 >= mask  # the mask at least: it is not in the whole-window run
    assert two - one / 2 < LAYERS * mask  # not one a layer


def test_the_plan_of_pp_x_cp_cuts_every_stage_s_windows_as_the_pipeline_runs_them():
    """The stages' passes run on this rank's chunks with the cut's positions and attention reaching every stage (the
    pipeline runner's one_tensor), so each pipeline rank keeps what a cp 2 rank keeps, and cp's traffic is counted."""
    figures = plan_run(load_config(None, [*GPT, "train.global_batch_size=4", "dist.pipeline_parallel=2",
                                          "dist.context_parallel=2",
                                          f"model.kwargs={{n_layers = {LAYERS}, n_heads = 4, dim = {DIM}, "
                                          "tie_weights = false}"]), Machine(1, 8))
    assert figures["mesh"] == {"pp": 2, "shard": 2, "cp": 2}
    # a micro-batch of 2 windows a data-parallel rank; a pipeline rank's one layer; K and V of its half windows
    own = (LAYERS // 2) * 2 * 2 * (SEQ // 2) * DIM * 4
    assert _by(figures, "cp") == {"all-gather": pytest.approx(own), "reduce-scatter": pytest.approx(own)}
