"""Expert parallel's collective: rows sorted by expert sent to the ranks that hold their experts, computed there, and
sent back (counts by one all-to-all, rows by two with autograd), shared by the built-in experts' forward
(expert_parallel) and transformers' fused experts' (hf_expert_parallel)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from distrib.torch_private import all_to_all_single, all_to_all_single_autograd, is_fake

# What the local experts compute: (rows sorted by local expert, rows per local expert) -> output rows.
Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
