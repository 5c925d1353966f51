"""distrib plan's activations as the target runs them (distrib.plan.activations), in process on torch's fake process
group: one rank's slices under tensor parallel, the fused attention kernel's saved tensors (no s x s scores), what a
real CPU forward saves, checkpointing's recompute counted once per pipeline rank, the fixes that are not on already,
and a Llama-3-70B shape at pp 8 x tp 8 x fsdp 16 on 1,024 ranks that fits 80 GB with checkpointing."""

import numpy as np
import pytest
import torch

from distrib.config import load_config
from distrib.plan import GIB, Machine, plan_run, table
from distrib.plan.saved import activation_bytes

GPT = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 4, dim = 64, hidden_dim = 256}", "data.name=text",
       "data.root=/usr/share/common-licenses/GPL-3", "data.seq_len=32", "train.global_batch_size=8",
       "train.optimizer=adamw", "dist.strategy=fsdp"]
LLAMA_70B = ("{vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, "
             "num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192}")


def _activations(*sets: str, world: int = 4) -> int:
    return plan_run(load_config(None, [*GPT, *sets]), Machine(1, world))["activation_bytes_per_micro_batch"]


def test_tensor_parallel_divides_what_it_splits_and_keeps_the_residual_stream_whole():
    """A rank's activations under tp t are R + S / t: what the split layers compute (q, k, v, attention's output,
    the MLP's hidden units) divided by t, the residual stream and the norms (no sequence parallel) whole. So the
    step from tp 1 to 2 saves twice the step from 2 to 4, and neither is all of it. The micro-batch is the same
    (2 windows a rank: fsdp over world / tp ranks, the global batch scaled with them)."""
    one = _activations("dist.tensor_parallel=1", "train.global_batch_size=2", world=1)
    two = _activations("dist.tensor_parallel=2", "train.global_batch_size=2", world=2)
    four = _activations("dist.tensor_parallel=4", "train.global_batch_size=2", world=4)
    split = 2 * (one - two)
    assert one - two == 2 * (two - four) > 0
    assert one - split > 0  # the residual stream and the norms, on every rank of the group


def _attention_only(seq_len: int, device: str) -> int:
    """The activations of the GPT at seq_len under the device's attention kernel (one rank, no split)."""
    return _activations(f"data.seq_len={seq_len}", "train.global_batch_size=1", f"dist.device={device}", world=1)


def test_a_cuda_target_keeps_no_s_by_s_scores():
    """On CUDA (flash attention) and on the CPU (flash attention for the CPU) attention keeps its inputs, output and
    a logsumexp: the activations grow linearly with the sequence, where the meta device's math kernel (what plan
    counted before) adds the s x s probabilities of every head."""
    for device in ("cuda", "cpu"):  # linear: a + b s (a: the loss's scalars)
        at = {seq: _attention_only(seq, device) for seq in (32, 64, 128)}
        assert at[128] - at[64] == 2 * (at[64] - at[32]) > 0
    from distrib.data import load_data  # the math kernel, as the meta device runs it unless told the target's
    from distrib.distributed.runtime import Runtime
    from distrib.plan.rank import meta_model

    config = load_config(None, [*GPT, "data.seq_len=64"])
    info = load_data(config.data, Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo"), 0, log=lambda m: None).info
    tokens = torch.zeros(1, 64, dtype=torch.long, device="meta")
    model = meta_model(config, info)
    math, _ = activation_bytes(model, tokens, tokens, list(model.layers))
    heads, layers = 4, 2
    assert math - _attention_only(64, "cuda") >= layers * heads * 64 * 64 * 4  # at least the probabilities


def test_the_fused_kernel_saves_what_a_real_cpu_forward_saves():
    """The count on meta under the CPU target's kernel equals the bytes a real CPU forward of the same model saves
    (torch's own flash attention for the CPU), tensor by tensor."""
    from distrib.models.gpt import GPT as Model
    from distrib.plan.activations import target_attention

    torch.manual_seed(0)
    real = Model(vocab_size=256, seq_len=64, n_layers=2, n_heads=4, dim=64)
    with torch.device("meta"):
        meta = Model(vocab_size=256, seq_len=64, n_layers=2, n_heads=4, dim=64)
    tokens = torch.randint(0, 256, (2, 64))
    measured, _ = activation_bytes(real, tokens, tokens, list(real.layers))
    with target_attention(torch.device("cpu")):
        planned, _ = activation_bytes(meta, tokens.to("meta"), tokens.to("meta"), list(meta.layers))
    assert planned == measured


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_fixes_never_name_what_is_on_and_give_a_figure_under_pipeline_parallel(schedule):
    """A pipeline run that does not fit: its fixes each carry a peak, checkpointing's the peak plan gives the run
    with it; with checkpointing on, no fix names it again. Under gpipe the highest rank (the last) peaks where its
    first backward ends, its gradients whole beside one microbatch fewer: that microbatch's bytes with checkpointing
    are the fix's too."""
    base = [*GPT, "model.kwargs={n_layers = 4, n_heads = 4, dim = 64, tie_weights = false}",
            "train.global_batch_size=16", "dist.device=cuda", "dist.pipeline_parallel=2",
            f"dist.pipeline_schedule={schedule}"]
    on = ["speed.activation_checkpointing=blocks"]
    fits = plan_run(load_config(None, base), Machine(1, 4))
    short = Machine(1, 4, device_memory=fits["memory_bytes_per_rank"] - 1)
    off = plan_run(load_config(None, base), short)
    fixes = {fix["fix"]: fix for fix in off["fixes"]}
    checkpointed = plan_run(load_config(None, [*base, *on]), short)
    assert fixes["--set speed.activation_checkpointing=blocks"]["memory_bytes_per_rank"] == \
        checkpointed["memory_bytes_per_rank"] < off["memory_bytes_per_rank"]
    assert "--set speed.activation_checkpointing=blocks: " in table(off, short)
    still = plan_run(load_config(None, [*base, *on]),
                     Machine(1, 4, device_memory=checkpointed["memory_bytes_per_rank"] - 1))
    assert not still["fits"] and still["fixes"]
    assert not any("activation_checkpointing" in fix["fix"] for fix in still["fixes"])
    assert all(fix["memory_bytes_per_rank"] < still["memory_bytes_per_rank"] for fix in still["fixes"])


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    np.zeros(130 * 8192, dtype=np.uint16).tofile(root / "train.bin")
    np.zeros(2 * 8192, dtype=np.uint16).tofile(root / "val.bin")
    return root


def test_llama_3_70b_at_pp_8_tp_8_fsdp_16_fits_80_gb_with_checkpointing(tokens):
    """Llama-3-70B's shape, bf16, AdamW, seq 8192, global batch 128 at pp 8 x tp 8 x fsdp 16 on 1,024 ranks (1f1b, 8
    microbatches of 1 window: pipeline rank 0 keeps 8 in flight). With checkpointing it fits and says so; by hand
    (docs/parallelism.md): a block keeps its input, 8192 x 8192 bf16 = 128 MiB, 10 blocks x 8 microbatches = 10 GiB,
    and one block recomputes at a time. Without, each block keeps about 1.17 GiB a microbatch at tp 8 (its two
    norms' fp32 and bf16 copies of the residual stream whole, 768 MiB; q, k, v, attention and the MLP's hidden units
    1/8), over 80 GB, and the fixes name checkpointing with its figure."""
    sets = ["data.name=tokens", f"data.root={tokens}", "data.vocab_size=50304", "data.seq_len=8192",
            "model.factory=tests.helpers.pretrained:llama", f"model.kwargs={LLAMA_70B}", "train.precision=bf16",
            "train.optimizer=adamw", "train.global_batch_size=128", "dist.device=cuda", "dist.strategy=fsdp",
            "dist.pipeline_parallel=8", "dist.tensor_parallel=8"]
    machine = Machine(128, 8)
    on = plan_run(load_config(None, [*sets, "speed.activation_checkpointing=blocks"]), machine)
    assert on["state_bytes_per_rank"] == 1_201_053_696  # checked by hand (issue 51)
    assert on["fits"] and on["memory_bytes_per_rank"] < 80 * GIB
    said = [line for line in table(on, machine).splitlines() if line.startswith("device memory")]
    assert said[0].split()[2] == "fits:"
    first = on["stages"][0]
    assert first["stages"][0]["microbatches_in_flight"] == 8
    inputs = 8 * 10 * 8192 * 8192 * 2  # the blocks' inputs
    assert inputs < first["activation_bytes_in_flight"] < inputs + 2.5 * GIB  # + embedding's output, one block
    off = plan_run(load_config(None, sets), machine)
    per_block = (off["stages"][0]["activation_bytes_in_flight"] - 8 * 8192 * 8192 * 2) / 80  # less the sends
    assert per_block == pytest.approx(1300.3 * 2**20, rel=0.01)
    # by hand (docs/parallelism.md): the first backward starts with all 8 in flight, 8 x (10 x 1300.3 + 128) MiB, and
    # ends with 7 and the stage's gradients whole (the blocks' and the embedding's fp32 slices, and the embedding's
    # whole bf16 gradient its backward computes on every tp rank before its slice is taken): the start is the peak,
    # beside the state, the stage's parameters gathered over tp and its gradients' receive buffers
    in_flight, unsharded = 8 * (10 * 1300.3 + 128) * 2**20, 10 * 855.6e6 * 4 / 8 + 1.051e9 * (2 + 4 / 8)
    assert 7 / 8 * in_flight + unsharded < in_flight
    held = (286.35 + 572.71) * 2**20 + 9.607e9 * 2 / 8 + 8 * 128 * 2**20  # parameters, optimizer, gathered, buffers
    assert off["memory_bytes_per_rank"] == pytest.approx(held + in_flight, rel=0.002)
    # with checkpointing rank 0's peak is the end of its first backward: 8 x (10 x 128 + 128) MiB in flight and one
    # layer recomputed (1300.3 MiB), less the microbatch it freed (10 x 128 + 128 MiB), beside the gradients: 21.40 GiB
    checkpointed = (8 * (10 * 128 + 128) + 1300.3 - (10 * 128 + 128)) * 2**20
    assert first["memory_bytes"] == pytest.approx(held + checkpointed + unsharded, rel=0.002)
    assert on["memory_bytes_per_rank"] == max(rank["memory_bytes"] for rank in on["stages"])
    assert not off["fits"] and [fix for fix in off["fixes"] if fix["fits"]][0] == {
        "fix": "--set speed.activation_checkpointing=blocks", "fits": True,
        "memory_bytes_per_rank": on["memory_bytes_per_rank"]}
