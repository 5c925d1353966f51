"""The plan's cost model of a layout: the bytes each rank sends per step over the mesh's dimensions (ring collectives,
hierarchical across nodes) and what start-up holds before the first step, as functions of the run's ParallelDims."""

from __future__ import annotations

from distrib.config import DistConfig
from distrib.distributed import pipeline
from distrib.distributed.mesh import ParallelDims


def group_split(size: int, inner: int, per_node: int, nbytes: float, rounds: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends in a ring collective over a mesh dimension of `size` ranks
    spaced `inner` apart (ranks numbered node by node), done hierarchically: within the node over its ranks of the
    group, then across nodes on 1/l of the data each. rounds: 1 all-gather / reduce-scatter, 2 all-reduce."""
    local = max(1, min(size, per_node // inner)) if per_node % inner == 0 else 1
    nodes = size // local
    return rounds * (local - 1) / local * nbytes, rounds * (nodes - 1) / nodes * nbytes / local


def step_traffic(dims: ParallelDims, config: DistConfig, per_node: int, local_params: int, compute_bytes: int,
                 grad_accum: int, tp_activation_bytes: float = 0) -> tuple[float, float]:
    """(intra-node, inter-node) bytes each rank sends per optimizer step for gradients and parameters. DDP: one
    all-reduce of the fp32 gradients. FSDP2: all-gathers of parameters in every forward (and backward, when
    resharded) of every micro-step (under pipeline parallel: of every microbatch), one reduce-scatter of fp32
    gradients, and over a replicate degree an all-reduce of the gradient shards; tensor parallel all-reduces
    tp_activation_bytes per micro-step within its group. (The activations between stages: distrib.plan.pipeline.)"""
    if not dims.fully_shard:
        return group_split(dims.replicate, 1, per_node, local_params * 4, 2)
    if dims.pipeline > 1:
        grad_accum *= pipeline.microbatches(config)
    tp = dims.tensor_parallel
    parts = [group_split(tp, 1, per_node, tp_activation_bytes * grad_accum, 2) if tp > 1 else (0, 0)]
    gathered = local_params * dims.shard
    gathers = grad_accum * (2 if config.reshard_after_forward else 1)
    parts += [group_split(dims.shard, tp, per_node, gathered * compute_bytes, gathers),
              group_split(dims.shard, tp, per_node, gathered * 4, 1)]
    if dims.replicate > 1:
        parts.append(group_split(dims.replicate, dims.shard * tp, per_node, local_params * 4, 2))
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def startup_memory(dims: ParallelDims, parameter_bytes_per_rank: int, whole_bytes: int, largest_tensor_bytes: int,
                   self_initialising: bool, nproc_per_node: int, params_on_host: bool) -> tuple[int, int]:
    """(bytes the fullest rank holds while building and loading, before the first step; host bytes of the fullest node
    meanwhile). whole_bytes: the model's parameters and buffers; self_initialising: no whole copy is needed (the model
    initialises its own shards, or they are read from model.init_from); params_on_host: the device is the CPU, or
    dist.cpu_offload keeps the shards there."""
    if not dims.fully_shard:  # every rank builds the whole model on its host, then moves it to its device
        return whole_bytes, nproc_per_node * whole_bytes
    # Each rank materialises only its shards. A self-initialising model adds one whole tensor at a time on each
    # rank's host; any other is built whole once, on rank 0's host.
    extra = largest_tensor_bytes if self_initialising else whole_bytes
    shards_on_host = nproc_per_node * parameter_bytes_per_rank if params_on_host else 0
    per_node = (nproc_per_node * extra if self_initialising else extra) + shards_on_host
    return parameter_bytes_per_rank + extra, per_node
