"""Expert parallel (dist.expert_parallel = E), one degree of the mesh: each MoE layer's experts split over the `ep`
dimension (E ranks of the shard dimension, which read different batches), the tokens sent to their expert's rank and
back by two all-to-alls per layer (torchtitan's ExpertParallel, applied by the one parallelize before FSDP).

An experts module of the contract's form (distrib.models.moe.GroupedExperts: w1, w2, w3 experts first, forward(rows
sorted by expert, counts per expert)) keeps its class and names: its parameters become DTensors Shard(0) on `ep`, and
its forward is wrapped: counts exchanged, rows exchanged, put in local-expert order, the local experts run on them,
the order undone, the rows sent back. The MoE layer around it calls it as in one process."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from distrib.distributed.expert_modules import WEIGHTS, find_experts

# What the local experts compute: (rows sorted by local expert, rows per local expert) -> output rows.
Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_model(model: nn.Module, size: int) -> dict[str, nn.Module]:
    """The model's experts modules (find_experts: the contract's and transformers' fused ones), or a one-line
    ConfigError: none to split, a form expert parallel cannot split, or a count that size does not divide."""
    return {name: experts.module for name, experts in find_experts(model, size).items()}


def apply_expert_parallel(model: nn.Module, mesh) -> list[nn.Module]:
    """Each experts module's weights as DTensors Shard(0) over `mesh` (the ep dimension: each rank holds its
    1/E of the experts; on the meta device nothing is allocated) and its forward routed over the mesh's group
    (transformers' fused experts through hf_expert_parallel). Returns the modules, which FSDP then shards over what
    remains of the data-parallel ranks."""
    found = list(find_experts(model, mesh.size()).values())
    _quiet_expert_gathers()
    for experts in found:
        if experts.fused:
            from distrib.distributed.hf_expert_parallel import apply_hf_expert_parallel  # it imports route from here

            apply_hf_expert_parallel(experts.module, mesh, experts.adapters)
            continue
        module = experts.module
        for name in WEIGHTS:
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))
        module.forward = functools.partial(_routed_forward, module, module.forward, mesh.get_group())
    return [experts.module for experts in found]


class _ExpertGathers(logging.Filter):
    """Drops torch's warning (once per rank) that making an expert tensor whole takes one all-gather per dimension
    it is split over (FSDP's _StridedShard on top of ep's Shard): the weights' gathering at a save, not a step's cost,
    and nothing a user can change."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("sequential" in str(record.msg) and "_StridedShard" in str(record.args))


def _quiet_expert_gathers() -> None:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(each, _ExpertGathers) for each in logger.filters):
        logger.addFilter(_ExpertGathers())


@contextlib.contextmanager
def _local_weights(module: nn.Module) -> Iterator[None]:
    """The module's weights as this rank's local experts (plain tensors, differentiable into the DTensors) while its
    own forward runs: it multiplies them as in one process, on its n_experts / E experts."""
    held = {name: module._parameters[name] for name in WEIGHTS}
    try:
        for name, param in held.items():
            module._parameters[name] = param.to_local() if isinstance(param, DTensor) else param
        yield
    finally:
        module._parameters.update(held)


def _routed_forward(module: nn.Module, forward: Callable, group: dist.ProcessGroup, rows: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    def local(received: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        with _local_weights(module):
            return forward(received, local_counts)

    return route(rows, counts, group, local)


def route(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, compute: Compute) -> torch.Tensor:
    """rows (sorted by global expert, counts[e] of expert e) through the experts of every rank of `group`, each rank
    holding len(counts) / group size of them in order, and back: the output rows in the input's order. A collective
    of the group (two all-to-alls of rows, one of counts, in every call on every rank)."""
    ranks = dist.get_world_size(group)
    if is_fake(rows):  # distrib plan's dry run (a fake group, no values): each rank takes as many rows as it sends
        return compute(rows.clone(), counts.view(ranks, -1).sum(0)).clone()
    with torch.no_grad():  # how many rows each rank sends each of my local experts
        received_counts = all_to_all_single(counts.contiguous(), None, None, group=group).wait()
    sent = counts.view(ranks, -1).sum(1).tolist()  # a host sync: the all-to-all's sizes
    by_source = received_counts.view(ranks, -1)
    received = by_source.sum(1).tolist()
    gathered = all_to_all_single_autograd(rows.contiguous(), received, sent, group)
    order = local_expert_order(by_source)
    out = compute(gathered.index_select(0, order), by_source.sum(0))
    back = out.index_select(0, inverse(order))
    return all_to_all_single_autograd(back.contiguous(), sent, received, group)


def local_expert_order(by_source: torch.Tensor) -> torch.Tensor:
    """The rows an all-to-all delivered, source-major ([source][local expert] blocks, by_source[s, e] rows each), as
    indices in local-expert-major order (each expert's rows from source 0, then 1, ...): what grouped_mm takes."""
    ranks, local = by_source.shape
    block = torch.arange(ranks * local, device=by_source.device)
    expert_major = (block % local) * ranks + block // local  # block (s, e) -> its place e * ranks + s
    keys = torch.repeat_interleave(expert_major, by_source.flatten())
    return torch.argsort(keys, stable=True)


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order`."""
    undone = torch.empty_like(order)
    undone[order] = torch.arange(len(order), device=order.device)
    return undone
