"""Which block of a (DTensor) tensor this rank holds, reads and writes: its global offsets and sizes, their slices,
its local part, and whether it is the one replica that writes it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate


def local_block(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, sizes) of the block this rank holds: a DTensor's local shard (FSDP's rows, tensor
    parallel's columns, both, uneven ones included), or the whole of a plain tensor."""
    if isinstance(tensor, DTensor):
        from distrib.torch_private import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple(offsets), tuple(sizes)
    return (0,) * tensor.dim(), tuple(tensor.shape)


def block_slices(offsets, sizes) -> tuple[slice, ...]:
    return tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes))


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def writes_block(tensor: torch.Tensor, rank: int) -> bool:
    """Whether this rank writes its block: of the ranks holding the same block (replicas: hsdp's groups, tensor
    parallel's norms, a plain tensor on every rank) only the first."""
    if tensor.is_meta:  # another pipeline stage's: its own ranks write it
        return False
    if isinstance(tensor, DTensor):
        coordinate = tensor.device_mesh.get_coordinate() or []
        return all(coordinate[dim] == 0 for dim, placement in enumerate(tensor.placements)
                   if isinstance(placement, Replicate))
    return rank == 0
