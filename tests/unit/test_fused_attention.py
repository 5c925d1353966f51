"""The dry run's attention for a CUDA target (distrib.plan.attention): what it saves for backward against torch's own
fused kernel (the CPU's flash kernel, which keeps the same tensors) and its math kernel (s x s scores), its gradients'
shapes, grouped-query heads, activation checkpointing's recompute, and the swap undone."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from distrib.plan.attention import target_attention


def _saved(attend, *inputs) -> list[torch.Size]:
    """The shapes autograd saves while `attend(*inputs)` runs."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
        attend(*inputs)
    return shapes


def _qkv(kv_heads: int = 4):
    return [torch.randn(2, heads, 64, 16, requires_grad=True) for heads in (4, kv_heads, kv_heads)]


def _numel(shapes) -> int:
    return sum(torch.Size(s).numel() for s in shapes)


def test_it_saves_what_the_fused_kernel_saves_and_no_scores():
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with target_attention("cuda"):
        ours = _saved(attend, *_qkv())
    fused = _saved(attend, *_qkv())  # the CPU's flash kernel: q, k, v, output, logsumexp
    with sdpa_kernel(SDPBackend.MATH):
        math = _saved(attend, *_qkv())
    assert sorted(ours) == sorted(fused) == sorted([(2, 4, 64, 16)] * 4 + [(2, 4, 64)])
    assert not any(s[-2:] == (64, 64) for s in ours) and any(s[-2:] == (64, 64) for s in math)
    assert _numel(math) > _numel(ours)


def test_its_gradients_have_the_inputs_shapes_under_grouped_query_heads_and_checkpointing():
    q, k, v = _qkv(kv_heads=2)
    with target_attention("cuda"):
        out = checkpoint(lambda q, k, v: F.scaled_dot_product_attention(q * 2, k, v, enable_gqa=True), q, k, v,
                         use_reentrant=False)
        assert out.shape == q.shape
        out.sum().backward()  # the recompute runs the fused footprint again: the same tensors saved
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]


def test_a_cpu_target_keeps_torchs_function_and_the_swap_is_undone():
    original = F.scaled_dot_product_attention
    with target_attention("cpu"):
        assert F.scaled_dot_product_attention is original
    with target_attention("auto"):
        assert F.scaled_dot_product_attention is not original
    assert F.scaled_dot_product_attention is original
