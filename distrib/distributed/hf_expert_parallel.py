"""Expert parallel for a transformers mixture of experts: each MoE layer's fused experts-first tensors split over the
`ep` ranks (DTensors Shard(0), their names kept), and the experts module's forward replaced by distrib's dispatch.

transformers' experts forward takes (hidden states, top_k_index, top_k_weights) with global expert ids and indexes
its tensors by them. In its place: the (token, choice) pairs sorted by expert, sent to their experts' ranks and back
by distrib.distributed.expert_parallel.route (the contract's forward(rows sorted by expert, counts)), where each rank
runs the module's own forward (whichever experts implementation its config chose) on its local experts, with local
ids and unit weights; the router's weights are applied after, and each token's top-k rows summed as transformers
sums them. The routing is the model's own: the MoE block's router is untouched."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from distrib.distributed.expert_parallel import inverse, route


def apply_hf_expert_parallel(module: nn.Module, mesh) -> None:
    """One transformers experts module (fused, experts-first: expert_modules.find_experts says which) with its
    tensors as DTensors Shard(0) over `mesh` (the ep dimension: 1/E of the experts on each rank; nothing allocated on
    the meta device) and its forward routed over the mesh's group; FSDP then shards it over what remains of the
    data-parallel ranks (as apply_expert_parallel's)."""
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                     requires_grad=param.requires_grad))
    module.forward = functools.partial(dispatched_forward, module, module.forward, mesh.get_group())


@contextlib.contextmanager
def _local_experts(module: nn.Module) -> Iterator[int]:
    """The module's tensors as this rank's experts (plain tensors, differentiable into the DTensors) and its
    num_experts as their count, while its own forward runs on them; yields the count."""
    held = dict(module._parameters)
    count = module.num_experts
    try:
        for name, param in held.items():
            if isinstance(param, DTensor):
                module._parameters[name] = param.to_local()
        module.num_experts = next(iter(module._parameters.values())).shape[0]
        yield module.num_experts
    finally:
        module._parameters.update(held)
        module.num_experts = count


def dispatched_forward(module: nn.Module, forward: Callable, group: dist.ProcessGroup, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """What transformers' experts forward returns (each token's top-k expert outputs weighted and summed), computed
    by the experts' ranks of `group`: a collective of the group in every call."""
    tokens, top_k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # the (token, choice) pairs, by expert
    counts = torch.bincount(experts, minlength=module.num_experts)

    def local(rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        with _local_experts(module) as count:
            # output_size: no host sync for the ids' length (and the dry run's fake rows have no values to count)
            ids = torch.repeat_interleave(torch.arange(count, device=rows.device), local_counts, output_size=len(rows))
            return forward(rows, ids[:, None], torch.ones(len(rows), 1, dtype=top_k_weights.dtype,
                                                         device=rows.device))

    out = route(hidden_states[order // top_k], counts, group, local)
    weighted = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
    pairs = weighted.index_select(0, inverse(order))  # back in (token, choice) order
    return pairs.view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)
