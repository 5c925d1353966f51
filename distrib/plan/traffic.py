"""What the step's traffic is counted from beside the state (distrib.plan.cost sums it): the elements tensor parallel
all-reduces per pass, the bytes the degrees' forwards count (dimensions.counted), the share of the parameters outside
the blocks, each as a run counts them (scripts/bench_traffic.py); and the terms plan_run hands cost's functions."""

from __future__ import annotations

import math

import torch.nn as nn

from distrib.config import Config
from distrib.distributed import dimensions, fsdp
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.tensor_parallel import layers_split
from distrib.plan.batch import positions
from distrib.plan.saved import tensor_bytes


def passes(config: Config, dims: ParallelDims) -> int:
    """The forwards a micro-step runs per block, as the degrees declare them (a pipeline's microbatches)."""
    return math.prod(dimension.passes(dims, config.dist) for dimension in dimensions.DIMENSIONS)


def counted_bytes(config: Config, dims: ParallelDims, own: int) -> tuple[int, int]:
    """(all-gathered, reduce-scattered) bytes of what a rank's degrees count of its own a pass (StepCost.counted_bytes),
    from `own`, the whole model's over one micro-batch (rank_activations' forward): a pipeline rank runs 1/pp of the
    layers, and a pass is one of the degrees' pieces of the micro-batch (a pipeline's microbatches); the all-gather
    again in each block's recomputation."""
    own = own / (dims.pipeline * passes(config, dims))
    return own * (2 if config.speed.activation_checkpointing == "blocks" else 1), own


def root_share(model: nn.Module, config: Config, tensor_parallel: int) -> float:
    """The share of a rank's parameters outside the model's blocks (FSDP2 units of their own, or the root's), those
    that tensor parallel splits counted 1/tp."""
    split = {id(p) for style in ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")
             for m in layers_split(model, style) for p in m.parameters()} if tensor_parallel > 1 else set()
    blocks = fsdp.find_blocks(model, config.dist.shard_modules)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    held = {id(p): p.numel() / (tensor_parallel if id(p) in split else 1) for p in model.parameters()}
    total = sum(held.values())
    return 1 - sum(held[key] for key in in_blocks) / total if total else 0.0


def _recomputed_rowwise(block: nn.Module, rowwise: set[int]) -> int:
    """The row-wise outputs a checkpointed block's recompute all-reduces again (rowwise: the ids of the model's
    row-wise layers): all but its last one's, whose output no backward needs (torch's recompute stops before it;
    counted in runs: scripts/bench_traffic.py)."""
    held = [m for m in block.modules() if id(m) in rowwise]
    return sum(m.out_features for m in held[:-1])


def tp_activations(model: nn.Module, shape: ParallelDims, inputs, config: Config) -> float:
    """Elements tensor parallel all-reduces per forward pass (a pipeline's microbatch) of one pipeline rank's layers,
    as counted in a run (scripts/bench_traffic.py): each row-wise layer's output in forward (again when activation
    checkpointing recomputes it) and each column-wise layer's input gradient in backward (wq, wk and wv apiece); a
    row-wise embedding's output in forward; a gathered column-wise output (an lm_head's logits) gathered in forward,
    half an all-reduce's traffic, and its input gradient all-reduced in backward. A pipeline rank holds 1/pp of the
    layers (an even split)."""
    if shape.tensor_parallel == 1:
        return 0
    split = layers_split(model, "rowwise")
    rowwise = sum(m.out_features for m in split)
    if config.speed.activation_checkpointing == "blocks":  # torch's recompute stops at the last tensor backward needs
        ids = {id(m) for m in split}
        rowwise += sum(_recomputed_rowwise(block, ids) for block in fsdp.find_blocks(model, config.dist.shard_modules))
    colwise = sum(m.in_features for m in layers_split(model, "colwise"))
    embedding = sum(m.embedding_dim for m in layers_split(model, "embedding_rowwise"))
    gathered = sum(m.out_features / 2 + m.in_features for m in layers_split(model, "colwise_gather_output"))
    return positions(inputs) / passes(config, shape) * (rowwise + colwise + embedding + gathered) / shape.pipeline


def traffic_terms(config: Config, shape: ParallelDims, nproc_per_node: int, model: nn.Module, inputs,
                  local_params: int, expert_parameter_bytes: int, sent: int) -> tuple:
    """The arguments of distrib.plan.cost's step_traffic, named_traffic and collectives for a rank of `local_params`
    parameters and `expert_parameter_bytes` of experts, whose forward of `inputs` sends `sent` elements (what the
    degrees count: dimensions.counted)."""
    compute_bytes = 2 if config.train.precision == "bf16" else 4
    return (shape, config.dist, nproc_per_node, local_params, compute_bytes, config.train.grad_accum_steps,
            tp_activations(model, shape, inputs, config) * compute_bytes,
            root_share(model, config, shape.tensor_parallel),
            expert_parameter_bytes // 4,  # (FSDP2 keeps fp32 parameters)
            sum(tensor_bytes(b) for b in model.buffers()),
            counted_bytes(config, shape, sent * compute_bytes))
