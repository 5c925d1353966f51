"""The plan's cost model of a layout: the bytes each rank sends per step over the mesh's dimensions (ring collectives,
hierarchical across nodes) and what start-up holds before the first step, as functions of the run's ParallelDims.
Each degree's bytes are its declaration's (distrib.distributed.dimensions), through group_split, the unit of
traffic, re-exported here."""

from __future__ import annotations

from distrib.config import DistConfig
from distrib.distributed import dimensions
from distrib.distributed.dimensions import StepCost, group_split
from distrib.distributed.mesh import ParallelDims


def step_traffic(dims: ParallelDims, config: DistConfig, per_node: int, local_params: int, compute_bytes: int,
                 grad_accum: int, tp_activation_bytes: float = 0) -> tuple[float, float]:
    """(intra-node, inter-node) bytes each rank sends per optimizer step for gradients and parameters, each declared
    degree's (distrib.distributed.dimensions: DDP's all-reduce; FSDP2's all-gathers, reduce-scatter and the replicas'
    all-reduce; tensor parallel's all-reduces of tp_activation_bytes per pass; a pipeline's microbatches multiplying
    the passes). (The activations between stages: distrib.plan.pipeline; the experts' all-to-alls: plan.experts.)"""
    step = StepCost(per_node, local_params, compute_bytes, grad_accum, tp_activation_bytes)
    return dimensions.step_traffic(dims, config, step)


def named_traffic(dims: ParallelDims, config: DistConfig, per_node: int, local_params: int, compute_bytes: int,
                  grad_accum: int, tp_activation_bytes: float = 0) -> list[dict]:
    """The parts of step_traffic that the plan names on a line of their own (the all-reduce across replica groups):
    {name, intra_node, inter_node} bytes each rank sends per step."""
    step = StepCost(per_node, local_params, compute_bytes, grad_accum, tp_activation_bytes)
    return [{"name": name, "intra_node": intra, "inter_node": inter}
            for name, intra, inter in dimensions.traffic_lines(dims, config, step)]


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


__all__ = ["group_split", "named_traffic", "startup_memory", "step_traffic"]
