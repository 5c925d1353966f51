"""The activations a rank keeps, measured the way the target runs its forward: the model split as the run splits its
tensors (each degree's step at SPLIT_TENSORS: tensor parallel's slices, context parallel's cut of the windows), so the
saved tensors have one rank's shapes, and attention by the kernel the target's device runs.

Attention: torch's meta device runs scaled_dot_product_attention by its math decomposition, which keeps the s x s
probabilities of every head. No target keeps them: on CUDA the flash kernel (the memory-efficient one under a mask) and
on the CPU flash attention for the CPU both save their inputs, their output and one float32 logsumexp per query and
head (ScaledDotProductFlashAttentionForCpuBackward0, _scaled_dot_product_flash_attention's saved tensors); the CPU
falls back to the math kernel only for dropout in training. target_attention(device) runs the dry run's FusedAttention
(distrib.plan.attention) in its place, whose forward allocates and saves exactly those.

A rank's forward under fsdp and data parallel is the model's own: only the degrees that split tensors change what it
saves. Under tensor parallel (no sequence parallel: the plans distrib applies split no norm) the residual stream, the
norms' inputs and outputs, stay whole on every rank; q, k, v, the attention's output and the MLP's hidden units are
1/tp of the model's."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from distrib.distributed import dimensions
from distrib.distributed.dimensions.base import SPLIT_TENSORS, Layout
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime
from distrib.plan.attention import FusedAttention

FUSED, MATH = "fused", "math"


def attention_kernel(device: torch.device, dropout_p: float = 0.0) -> str:
    """The kernel a target's scaled_dot_product_attention runs: fused (flash, or memory-efficient under a mask) on an
    accelerator, flash for the CPU on the CPU but under dropout (then the math kernel)."""
    return MATH if device.type == "cpu" and dropout_p > 0 else FUSED


class _TargetAttention(TorchFunctionMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key, value, *rest = args
            dropout = kwargs.get("dropout_p", rest[1] if len(rest) > 1 else 0.0)
            if attention_kernel(self.device, dropout) == FUSED:
                mask = kwargs.get("attn_mask", rest[0] if rest else None)
                return FusedAttention.apply(query, key, value, mask if isinstance(mask, torch.Tensor) else None)
        return func(*args, **kwargs)


@contextlib.contextmanager
def target_attention(device: torch.device) -> Iterator[None]:
    """Within it, scaled_dot_product_attention keeps what it keeps on `device` (attention_kernel), whatever device
    its tensors are on (meta, fake)."""
    with _TargetAttention(device):
        yield


def split_steps(dims: ParallelDims) -> list:
    """The parallelize steps of the degrees on this run that split the model's tensors (the declared ones at
    SPLIT_TENSORS), in their order."""
    return [d.parallelize for d in dimensions.DIMENSIONS if d.step_at == SPLIT_TENSORS and d.on(dims)]


def split_as_run(model: nn.Module, dims: ParallelDims, config, runtime: Runtime) -> nn.Module:
    """The meta model with the run's tensor-splitting steps applied (over the mesh the plan's state built on the fake
    group; rank 0's slices): what one rank computes its forward with. Nothing to do without such a degree."""
    steps = split_steps(dims)
    if not steps:
        return model
    dims.build_mesh("cpu")  # built already by the state's layout: the same one
    layout = Layout(dims, config.dist, runtime, config.speed, config.train.precision, lambda line: None, None, False)
    for step in steps:
        model = step(model, layout)
    return model


def rank_batch(batch, dims: ParallelDims):
    """Rank 0's micro-batch as the degrees cut it (context parallel: its cut of every window)."""
    return dimensions.transform_batch(batch, dims, 0)
