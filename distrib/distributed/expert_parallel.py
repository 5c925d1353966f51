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
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from distrib.distributed.expert_modules import WEIGHTS, find_experts
from distrib.distributed.expert_routing import route
from distrib.distributed.hf_expert_parallel import apply_hf_expert_parallel
from distrib.torch_private import REDISTRIBUTE_LOGGER


def check_model(model: nn.Module, size: int) -> dict[str, nn.Module]:
    """The model's experts modules (find_experts: the contract's and transformers' fused ones), or a one-line
    ConfigError: none to split, a form expert parallel cannot split, or a count that size does not divide."""
    return {name: experts.module for name, experts in find_experts(model, size).items()}


def apply_expert_parallel(model: nn.Module, mesh) -> list[nn.Module]:
    """Each experts module's weights as DTensors Shard(0) over `mesh` (the ep dimension: each rank holds its
    1/E of the experts; on the meta device nothing is allocated) and its forward routed over the mesh's group
    (transformers' fused experts through hf_expert_parallel; the collective: expert_routing). Returns the modules,
    which FSDP then shards over what remains of the data-parallel ranks."""
    found = list(find_experts(model, mesh.size()).values())
    _quiet_expert_gathers()
    for experts in found:
        if experts.fused:
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
    logger = logging.getLogger(REDISTRIBUTE_LOGGER)
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
