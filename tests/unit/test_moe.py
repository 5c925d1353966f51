"""The built-in GPT's mixture of experts in one process: the layer against a per-token loop, grouped_mm against the
per-expert loop, the dense GPT unchanged, capacity drops, each step's counts (tokens per expert + dropped = tokens x
top_k), DeepSeek-V3's bias update, a pipeline stage's aux loss in its backward, and the kwargs' one-line refusals.
(Training against one process under fsdp and pp: tests/integration/test_moe_gpt.py.)"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from distrib.distributed.mesh import ParallelDims
from distrib.distributed.pipeline import split_stages, view
from distrib.errors import ConfigError
from distrib.models.gpt import GPT
from distrib.models.moe import GroupedExperts, MoE
from distrib.training.experts import ExpertLoad

DIM, HIDDEN, EXPERTS = 16, 32, 4


def _moe(dtype=torch.float32, seed: int = 0, **kwargs) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(DIM, HIDDEN, EXPERTS, kwargs.pop("top_k", 2), **kwargs)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return moe.to(dtype)


def _naive(moe: MoE, x: torch.Tensor, keep=None) -> torch.Tensor:
    """Token by token: softmax scores, top_k of scores + bias, each chosen expert's SwiGLU x its renormalised score;
    keep(token, expert) False drops the pair."""
    experts, out = moe.experts, []
    for index, token in enumerate(x.reshape(-1, DIM)):
        scores = F.softmax(moe.gate(token).float(), -1)
        top = torch.topk(scores + moe.expert_bias, moe.top_k).indices.tolist()
        total = sum(scores[e] for e in top) if moe.top_k > 1 else 1.0
        routed = [scores[e] / total * (experts.w2[e] @ (F.silu(experts.w1[e] @ token) * (experts.w3[e] @ token)))
                  for e in top if keep is None or keep(index, e)]
        shared = moe.shared_experts(token) if moe.shared_experts is not None else 0
        out.append(sum(routed, torch.zeros_like(token)) + shared)
    return torch.stack(out).view_as(x)


def _grads(module, loss) -> dict:
    module.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize("dtype,top_k,shared", [(torch.float64, 2, 1), (torch.float32, 2, 0), (torch.float32, 1, 2)])
def test_the_moe_layer_equals_a_per_token_loop(dtype, top_k, shared):
    moe = _moe(dtype, top_k=top_k, n_shared_experts=shared, aux_loss_coef=0.01)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.05, -0.05, 0.02]))  # moves the choice, not the weights
    x = torch.randn(3, 5, DIM, dtype=dtype)
    out, reference = moe(x), _naive(moe, x)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert (out - reference).abs().max() < tolerance
    assert moe.aux_loss is not None and moe.aux_loss.dim() == 0
    got, want = _grads(moe, (out * reference.detach()).sum()), _grads(moe, (_naive(moe, x) * reference.detach()).sum())
    for name in want:
        assert torch.allclose(got[name], want[name], atol=tolerance * 10), name


def test_grouped_mm_equals_the_per_expert_loop_forward_and_backward():
    experts = GroupedExperts(EXPERTS, DIM, HIDDEN)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.2)
    counts = torch.tensor([5, 0, 7, 3])  # an expert without rows
    x = torch.randn(int(counts.sum()), DIM, requires_grad=True)
    assert experts.grouped_mm_fits(x) and not experts.grouped_mm_fits(x.double())
    assert not experts.grouped_mm_fits(x[:0])  # grouped_mm's backward fails on no rows: the loop takes them
    target = torch.randn(len(x), 2 * DIM)[:, ::2]  # a strided output gradient, as a transposed view gives
    grouped = experts(x, counts)
    (grouped * target).sum().backward()
    got = [t.grad.clone() for t in (x, *experts.parameters())]
    x.grad = None
    experts.zero_grad()
    looped = experts.loop(x, counts)
    (looped * target).sum().backward()
    assert torch.allclose(grouped, looped, atol=1e-6)
    for a, b in zip(got, (x, *experts.parameters())):
        assert torch.allclose(a, b.grad, atol=1e-5)
    assert experts.w1.grad[1].abs().sum() == 0  # no rows, no gradient, but one (zero) all the same
    assert experts(x[:0], torch.zeros(EXPERTS, dtype=torch.int64)).shape == (0, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # grouped_mm is no autocast op: cast as a matmul would be
        assert experts.grouped_mm_fits(x, torch.bfloat16)
        assert torch.allclose(experts(x, counts).float(), looped, atol=0.05, rtol=0.05)


def test_capacity_drops_the_pairs_past_it_and_counts_them():
    moe = _moe(capacity_factor=0.5)
    x = torch.randn(2, 8, DIM)
    with torch.enable_grad():
        out = moe(x)
    tokens = 16
    capacity = math.ceil(0.5 * tokens * 2 / EXPERTS)
    assert moe.tokens_per_expert.max() <= capacity and moe.dropped_tokens > 0
    assert moe.tokens_per_expert.sum() + moe.dropped_tokens == tokens * moe.top_k
    # the pairs kept are each expert's first tokens, in token order
    choice = moe.route(x.reshape(-1, DIM))[1]
    seen: dict[int, int] = {}
    kept = set()
    for token in range(tokens):
        for expert in choice[token].tolist():
            seen[expert] = seen.get(expert, 0) + 1
            if seen[expert] <= capacity:
                kept.add((token, expert))
    reference = _naive(moe, x, keep=lambda token, expert: (token, expert) in kept)
    assert (out - reference).abs().max() < 1e-5


def test_counts_are_of_training_forwards_once_and_the_load_sums_them_over_a_step():
    model = GPT(vocab_size=32, seq_len=8, n_layers=3, n_heads=2, dim=16, n_experts=4, top_k=2, moe_layers=[0, 2],
                aux_loss_coef=0.01, capacity_factor=1.0)
    load = ExpertLoad.of(model, SimpleNamespace(dims=ParallelDims(1, 1)), torch.device("cpu"))
    assert load.names == ["layers.0.moe", "layers.2.moe"]
    with torch.no_grad():
        model(torch.randint(0, 32, (2, 8)))  # an evaluation's forward: not counted
    load.start(micro_steps=2)
    for _ in range(2):
        tokens = torch.randint(0, 32, (3, 8))
        # activation checkpointing's recompute runs the blocks' forwards again, in the backward: not counted again
        for layer in model.layers:
            layer.forward = lambda x, cos, sin, forward=type(layer).forward.__get__(layer): checkpoint(
                forward, x, cos, sin, use_reentrant=False)
        with set_checkpoint_early_stop(False):  # the recompute runs the whole block, its counting included
            model(tokens)["logits"].sum().backward()
    load.after_step(log=True)
    assert load.counts.shape == (2, 4)
    assert (load.counts.sum(dim=1) + load.dropped).tolist() == [2 * 3 * 8 * 2] * 2  # tokens x top_k, each layer
    figures = load.logged()
    assert set(figures) == {"expert_imbalance", "dropped_tokens"}
    assert figures["expert_imbalance"] == pytest.approx((load.counts.max(1).values / load.counts.mean(1)).max())
    assert figures["dropped_tokens"] == load.dropped.sum()


def test_the_bias_moves_each_expert_toward_the_mean_load_on_every_step():
    model = GPT(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, dim=16, n_experts=4, top_k=1, bias_update_rate=0.1)
    load = ExpertLoad.of(model, SimpleNamespace(dims=ParallelDims(1, 1, tensor_parallel=2)), torch.device("cpu"))
    load.start(micro_steps=1)
    for layer in model.layers:
        layer.moe.tokens_per_expert.copy_(torch.tensor([8, 2, 4, 2]) * 2)  # tensor parallel: counted twice
    load.after_step(log=False)  # not a log step: the bias still moves (it reduces every step)
    assert load.counts[0].tolist() == [8, 2, 4, 2] and load.logged() == {}
    for layer in model.layers:  # mean 4: above it down, below it up, at it unchanged
        assert torch.allclose(layer.moe.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.1]))
    load.start(micro_steps=1)
    assert all(layer.moe.tokens_per_expert.sum() == 0 for layer in model.layers)  # cleared for the next step
    assert "layers.0.moe.expert_bias" in model.state_dict()  # in checkpoints; the counts are not
    assert not any(name.endswith(("tokens_per_expert", "dropped_tokens")) for name in model.state_dict())


def test_the_dense_gpt_is_unchanged_and_moe_layers_replace_feed_forward():
    torch.manual_seed(0)
    plain = GPT(vocab_size=32, seq_len=8, n_layers=4, n_heads=2, dim=16, n_experts=0, top_k=7, aux_loss_coef=1.0)
    torch.manual_seed(0)
    dense = GPT(vocab_size=32, seq_len=8, n_layers=4, n_heads=2, dim=16)
    assert list(plain.state_dict()) == list(dense.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), dense.state_dict().values()))
    tokens = torch.randint(0, 32, (2, 8))
    assert isinstance(plain(tokens), torch.Tensor) and torch.equal(plain(tokens), dense(tokens))
    assert ExpertLoad.of(plain, SimpleNamespace(dims=ParallelDims(1, 1)), torch.device("cpu")) is None

    every_2nd = GPT(vocab_size=32, seq_len=8, n_layers=4, n_heads=2, dim=16, n_experts=4, moe_layers=2)
    assert [layer.moe is not None for layer in every_2nd.layers] == [False, True, False, True]
    names = list(every_2nd.state_dict())
    assert "layers.1.moe.experts.w1" in names and "layers.0.feed_forward.w1.weight" in names
    assert not any(name.startswith("layers.1.feed_forward") for name in names)
    assert isinstance(every_2nd(tokens), torch.Tensor)  # no aux loss: the logits as they are
    buffers = dict(every_2nd.named_buffers())  # DDP leaves each rank's counts alone (it would broadcast rank 0's)
    assert every_2nd._ddp_params_and_buffers_to_ignore and set(every_2nd._ddp_params_and_buffers_to_ignore) <= {
        name for name in buffers if name.startswith(("layers.1.moe.", "layers.3.moe.")) and "expert_bias" not in name}
    assert not hasattr(plain, "_ddp_params_and_buffers_to_ignore")


def test_flops_count_the_active_experts_only():
    kwargs = dict(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, dim=16, tie_weights=False, hidden_dim=64)
    dense = GPT(**kwargs)
    moe = GPT(**kwargs, n_experts=8, top_k=2, expert_hidden_dim=32, n_shared_experts=1)
    # each MoE layer runs 2 of its 8 experts of 32 hidden units (as many as the dense layer's 64), a shared expert of
    # 32 more, and the gate [8, 16]
    assert moe.flops_per_token() - dense.flops_per_token() == 6 * 2 * (3 * 16 * 32 + 8 * 16)
    everything = sum(p.numel() for p in moe.parameters()) - moe.tok_embeddings.weight.numel()
    assert moe.flops_per_token() < 6 * everything


def test_a_pipeline_stage_adds_its_aux_losses_to_its_backward_scaled_as_its_loss():
    model = GPT(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, dim=16, tie_weights=False, n_experts=4,
                aux_loss_coef=0.5)
    split = split_stages(model, 2, (), 2)
    first = view(model, split.units, set(split.stage_units(0)))
    tokens = torch.randint(0, 32, (2, 8))
    moe = model.layers[0].moe
    moe.aux_grad_scale = 0.25  # one microbatch's share of the step
    out = first(tokens)
    assert isinstance(out, torch.Tensor)
    expected = torch.autograd.grad(moe.aux_loss * 0.25, moe.gate.weight, retain_graph=True)[0]
    (out * 0).sum().backward()
    gate_grad = moe.gate.weight.grad  # the aux loss's gradient alone
    assert torch.allclose(gate_grad, expected) and gate_grad.abs().sum() > 0
    assert moe.aux_loss_sum.item() == pytest.approx(0.25 * moe.aux_loss.item())
    logged = moe.aux_loss_sum.item()
    with torch.no_grad():
        first(tokens)  # a forward-only pass (evaluation): nothing added, nothing logged
    assert moe.aux_loss_sum.item() == logged


@pytest.mark.parametrize("kwargs,says", [
    (dict(n_experts=4, top_k=5), "model.kwargs.top_k = 5: each token goes to top_k of the n_experts = 4"),
    (dict(n_experts=-1), "model.kwargs.n_experts = -1: must be a whole number >= 0"),
    (dict(n_experts=4, capacity_factor=-1.0), "model.kwargs.capacity_factor = -1.0: must be a number >= 0"),
    (dict(n_experts=4, aux_loss_coef="a"), "model.kwargs.aux_loss_coef = 'a': must be a number >= 0"),
    (dict(n_experts=4, moe_layers=[0, 9]), "model.kwargs.moe_layers = [0, 9]: neither \"all\""),
    (dict(n_experts=4, moe_layers=5), "model.kwargs.moe_layers = 5: neither"),
])
def test_moe_kwargs_out_of_range_are_one_line(kwargs, says):
    with pytest.raises(ConfigError) as error:
        GPT(vocab_size=32, seq_len=8, n_layers=4, n_heads=2, dim=16, **kwargs)
    assert str(error.value).startswith(says) and "\n" not in str(error.value)
