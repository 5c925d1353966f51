"""Attention as the dry run's target runs it. On CUDA, `F.scaled_dot_product_attention` of a training step runs a
fused kernel (flash or memory-efficient): it keeps for backward its inputs, its output and one float32 logsumexp per
query row, never the s x s scores. The dry run's fake tensors live on the CPU, where the same call would run the math
kernel (its s x s scores and softmax among the step's temporaries and saved tensors: 13.77 GiB of a 70B layout's
27.45 GiB peak), so for a CUDA target it runs `FusedAttention` instead: the fused kernel's outputs and saved tensors,
shapes only (the dry run never reads a value)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F


def fused_target(device: str) -> bool:
    """Whether a run of dist.device = `device` attends with a fused kernel: CUDA (auto: CUDA where the plan is for),
    not the CPU (whose math kernel the dry run's fake CPU tensors already run)."""
    return device != "cpu"


class FusedAttention(torch.autograd.Function):
    """The fused kernels' footprint: forward returns the output (the query's shape, the value's head size) and saves
    q, k, v, the output, a float32 logsumexp (batch, heads, queries) and the mask where one is given (the
    memory-efficient kernel's bias); backward holds, beside the three input gradients, what flash attention 2's
    backward allocates: the float32 row sums of dO x O, a float32 accumulator of the query's gradient and, where k and
    v have fewer heads than q (grouped-query), their gradients at q's head count, summed down at its end."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        # in the kernels' (batch, queries, heads, size) layout, as they return it: its transpose back is no copy
        out = q.new_empty((*q.shape[:-3], q.shape[-2], q.shape[-3], v.shape[-1])).transpose(-3, -2)
        logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        if mask is not None and mask.dtype == torch.bool:  # SDPA turns it into an additive one of q's dtype, each call
            mask = q.new_empty(mask.shape)
        ctx.save_for_backward(q, k, v, out, logsumexp, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, logsumexp, *_ = ctx.saved_tensors
        held = [torch.empty_like(logsumexp), torch.empty_like(q, dtype=torch.float32)]
        if k.shape[-3] != q.shape[-3]:
            held += [q.new_empty((*q.shape[:-1], t.shape[-1])) for t in (k, v)]
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None
        del held  # freed as the kernel returns
        return grads


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return FusedAttention.apply(query, key, value, attn_mask)


@contextlib.contextmanager
def target_attention(device: str) -> Iterator[None]:
    """While on, for a fused target (fused_target): `F.scaled_dot_product_attention` is FusedAttention, for every
    model that calls it through torch.nn.functional (the built-in GPT, transformers' sdpa attention). Swapped in the
    module, not caught by a torch function mode: activation checkpointing recomputes a block inside autograd's
    engine, which runs no Python mode, so the recomputed block would run the CPU kernel and save other tensors than
    its forward did."""
    if not fused_target(device):
        yield
        return
    original, F.scaled_dot_product_attention = F.scaled_dot_product_attention, _fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
