"""The plan's cost model of a layout: the bytes each rank sends per step over the mesh's dimensions (ring collectives,
hierarchical across nodes) and what start-up holds before the first step, as functions of the run's ParallelDims.
Each degree's bytes are its declaration's (distrib.distributed.dimensions), through group_split, the unit of
traffic, re-exported here."""

from __future__ import annotations

from distrib.config import DistConfig
from distrib.distributed import dimensions
from distrib.distributed.dimensions import StepCost, group_split
from distrib.distributed.mesh import EP, PP, ParallelDims


def step_traffic(dims: ParallelDims, config: DistConfig, *cost) -> tuple[float, float]:
    """(intra-node, inter-node) bytes each rank sends per optimizer step for gradients and parameters, each declared
    degree's (distrib.distributed.dimensions: DDP's all-reduce; FSDP2's all-gathers, reduce-scatter and the replicas'
    all-reduce; tensor parallel's all-reduces of tp_activation_bytes per pass; a pipeline's microbatches multiplying
    the passes). cost: StepCost's fields in order (per_node, local_params, compute_bytes, grad_accum,
    tp_activation_bytes, root_share, expert_params, buffer_bytes). (The activations between stages:
    distrib.plan.pipeline; the experts' all-to-alls: plan.experts.)"""
    return dimensions.step_traffic(dims, config, StepCost(*cost))


def named_traffic(dims: ParallelDims, config: DistConfig, *cost) -> list[dict]:
    """The parts of step_traffic that the plan names on a line of their own (the all-reduce across replica groups):
    {name, intra_node, inter_node} bytes each rank sends per step."""
    return [{"name": name, "intra_node": intra, "inter_node": inter}
            for name, intra, inter in dimensions.traffic_lines(dims, config, StepCost(*cost))]


def collectives(dims: ParallelDims, config: DistConfig, *cost, experts: dict | None = None,
                staged: dict | None = None) -> list[dict]:
    """The step's traffic by mesh dimension and collective: {dimension, kind, intra_node, inter_node} bytes each rank
    sends per step: step_traffic's parts, the experts' all-to-alls (distrib.plan.experts' figures) and the
    activations sent between pipeline stages (distrib.plan.pipeline's). Checked against the bytes a run's process
    groups carry: scripts/bench_traffic.py."""
    parts = [tuple(part) for part in dimensions.traffic_parts(dims, config, StepCost(*cost))]
    if experts and dims.expert_parallel > 1:
        parts.append((EP, "all-to-all", experts["all_to_all_bytes_per_step_intra_node"],
                      experts["all_to_all_bytes_per_step_inter_node"]))
    if staged and dims.pipeline > 1:
        parts.append((PP, "send", staged["pipeline_bytes_per_step_intra_node"],
                      staged["pipeline_bytes_per_step_inter_node"]))
    return [{"dimension": dimension, "kind": kind, "intra_node": intra, "inter_node": inter}
            for dimension, kind, intra, inter in parts]


def collective_rows(f: dict, size, intra_bandwidth: float, inter_bandwidth: float) -> list[tuple[str, str]]:
    """distrib plan's lines of the collectives' table: each mesh dimension's collectives per step and rank, and the
    time they take alone at the links' bandwidths (bytes per second)."""
    rows = []
    for c in f.get("collectives", []):
        seconds = max(c["intra_node"] / intra_bandwidth, c["inter_node"] / inter_bandwidth)
        rows.append(("" if rows else "  by dimension", f"{c['dimension']:<15} {c['kind']:<14} "
                     f"{size(c['intra_node']):>11} intra, {size(c['inter_node']):>11} inter, {seconds * 1e3:9.1f} ms"))
    return rows


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


__all__ = ["collective_rows", "collectives", "group_split", "named_traffic", "startup_memory", "step_traffic"]
