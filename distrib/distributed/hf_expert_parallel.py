"""Expert parallel for a transformers mixture of experts: each MoE layer's fused experts-first tensors split over the
`ep` ranks (DTensors Shard(0), their names kept), and the experts module's forward replaced by distrib's dispatch.

transformers' experts forward takes (hidden states, top_k_index, top_k_weights) with global expert ids and indexes
its tensors by them. In its place: the (token, choice) pairs sorted by expert, sent to their experts' ranks and back
by distrib.distributed.expert_parallel.route (the contract's forward(rows sorted by expert, counts)), where each rank
runs the module's own forward (whichever experts implementation its config chose) on its local experts, with local
ids and unit weights; the router's weights are applied after, and each token's top-k rows summed as transformers
sums them. The routing is the model's own: the MoE block's router is untouched. peft's LoRA on the fused tensors
(ParamWrapper: an A and a B per expert) is added by each rank to its own experts, from their rows of A and B."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from distrib.distributed.expert_routing import inverse, route
from distrib.distributed.hf_experts import lora_delta


def apply_hf_expert_parallel(module: nn.Module, mesh, adapters: tuple[nn.Module, ...] = ()) -> None:
    """One transformers experts module (fused, experts-first: expert_modules.find_experts says which) with its
    tensors as DTensors Shard(0) over `mesh` (the ep dimension: 1/E of the experts on each rank; nothing allocated on
    the meta device) and its forward routed over the mesh's group; FSDP then shards it over what remains of the
    data-parallel ranks (as apply_expert_parallel's). peft's LoRA wrappers around it (`adapters`) call it as it is:
    each rank adds their delta to its own experts only (_local_experts), where peft would add it to all."""
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                     requires_grad=param.requires_grad))
    for adapter in adapters:
        adapter.forward = module.__call__
    module.forward = functools.partial(dispatched_forward, module, module.forward, mesh.get_group(), adapters)


def _adapted(module: nn.Module, adapters: tuple[nn.Module, ...], first: int) -> None:
    """Each adapted tensor of the module (this rank's experts, from `first` on) plus its LoRA wrappers' delta for
    those experts: their rows of A and B (whole on every rank, sharded by FSDP like any dense parameter), so that
    each expert's A and B get the gradient of the tokens routed to it, once."""
    for adapter in adapters:
        if adapter.disable_adapters or adapter.merged:
            continue
        name = adapter.parameter_name
        experts = slice(first, first + module._parameters[name].shape[0])
        for active in adapter.active_adapters:
            if active in adapter.lora_A:
                delta = lora_delta(adapter, active, adapter.lora_A[active].weight, adapter.lora_B[active].weight,
                                   experts)
                module._parameters[name] = module._parameters[name] + delta.to(module._parameters[name].dtype)


@contextlib.contextmanager
def _local_experts(module: nn.Module, adapters: tuple[nn.Module, ...], group: dist.ProcessGroup) -> Iterator[int]:
    """The module's tensors as this rank's experts (plain tensors, differentiable into the DTensors, their LoRA
    delta added) and its num_experts as their count, while its own forward runs on them; yields the count."""
    held = dict(module._parameters)
    count = module.num_experts
    try:
        for name, param in held.items():
            if isinstance(param, DTensor):
                module._parameters[name] = param.to_local()
        module.num_experts = next(iter(module._parameters.values())).shape[0]
        _adapted(module, adapters, dist.get_rank(group) * module.num_experts)
        yield module.num_experts
    finally:
        module._parameters.update(held)
        module.num_experts = count


def dispatched_forward(module: nn.Module, forward: Callable, group: dist.ProcessGroup, adapters: tuple[nn.Module, ...],
                       hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                       ) -> torch.Tensor:
    """What transformers' experts forward returns (each token's top-k expert outputs weighted and summed), computed
    by the experts' ranks of `group`: a collective of the group in every call."""
    tokens, top_k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # the (token, choice) pairs, by expert
    # scatter_add_, not bincount: the same counts, shaped before the values (a fake step's recomputation)
    counts = torch.zeros(module.num_experts, dtype=torch.int64, device=experts.device).scatter_add_(
        0, experts, torch.ones_like(experts))

    def local(rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        with _local_experts(module, adapters, group) as count:
            # output_size: no host sync for the ids' length (and the dry run's fake rows have no values to count)
            ids = torch.repeat_interleave(torch.arange(count, device=rows.device), local_counts, output_size=len(rows))
            return forward(rows, ids[:, None], torch.ones(len(rows), 1, dtype=top_k_weights.dtype,
                                                         device=rows.device))

    out = route(hidden_states[order // top_k], counts, group, local)
    weighted = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
    pairs = weighted.index_select(0, inverse(order))  # back in (token, choice) order
    return pairs.view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)
