"""What every strategy shares about a model on a device: .to(device) with device-mismatch diagnostics, unwrap, gradient
clipping over several meshes, and the bytes of state each rank holds. The strategies themselves are in
distrib.distributed.strategies.

A mismatch error names every parameter, buffer or batch tensor that is off the worker's device, and where it is."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from distrib.distributed.runtime import Runtime
from distrib.errors import DeviceMismatchError, UserError

_MISMATCH_PHRASES = ("Expected all tensors to be on the same device", "is not on the expected device")
_MAX_LISTED = 10


def _same_device(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def misplaced_tensors(model: nn.Module, device: torch.device,
                      batch: dict[str, torch.Tensor] | None = None) -> list[str]:
    """'parameter conv1.weight is on meta' for every model or batch tensor not on `device`."""
    named = [("parameter", n, t) for n, t in model.named_parameters()]
    named += [("buffer", n, t) for n, t in model.named_buffers()]
    named += [("batch tensor", n, t) for n, t in (batch or {}).items()]
    return [f"{kind} {name} is on {t.device}" for kind, name, t in named if not _same_device(t, device)]


def mismatch_error(found: list[str], device: torch.device, fix: str) -> DeviceMismatchError:
    more = len(found) - _MAX_LISTED
    listed = "; ".join(found[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
    return DeviceMismatchError(f"device mismatch, expected {device} (this worker's device): {listed}; fix: {fix}")


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Moves the model to the worker's device and proves that every parameter and buffer arrived."""
    on_meta = [m for m in misplaced_tensors(model, device) if m.endswith(" is on meta")]
    if on_meta:  # .to() cannot move a meta tensor: it has no data
        raise mismatch_error(on_meta, device, "materialise meta tensors in the model factory "
                                         "(module.to_empty(device=...) then initialise) before returning the model")
    model.to(device)
    found = misplaced_tensors(model, device)
    if found:
        raise mismatch_error(found, device, "register these tensors with nn.Parameter or register_buffer so that "
                                       "model.to(device) moves them, and do not pin them to a device")
    return model


def check_batch(batch: dict[str, torch.Tensor], device: torch.device) -> None:
    found = misplaced_tensors(nn.Module(), device, batch)
    if found:
        raise mismatch_error(found, device, "move each batch tensor with .to(device) before the forward pass")


@contextlib.contextmanager
def explain_device_errors(model: nn.Module, device: torch.device, batch: dict[str, torch.Tensor]) -> Iterator[None]:
    """Re-raises PyTorch's 'Expected all tensors to be on the same device' with the names of the culprits."""
    try:
        yield
    except RuntimeError as e:
        if not any(phrase in str(e) for phrase in _MISMATCH_PHRASES):
            raise
        found = misplaced_tensors(unwrap(model), device, batch)
        if not found:
            found = ["every parameter, buffer and batch tensor is on the right device, so forward() made a tensor "
                     "elsewhere"]
        first_line = str(e).splitlines()[0]
        raise mismatch_error(found, device, f"create tensors inside forward() with device=input.device "
                                       f"(PyTorch said: {first_line})") from e


def sync_batchnorm(model: nn.Module, runtime: Runtime) -> nn.Module:
    """dist.sync_batchnorm: BatchNorm statistics over each micro-step's global batch, with an all-reduce per layer in
    every forward (torch's SyncBatchNorm, which runs on GPUs only)."""
    if not runtime.has_sync_batchnorm:
        raise UserError(f"dist.sync_batchnorm = true: torch's SyncBatchNorm runs on GPUs only, and this worker's "
                        f"device is {runtime.device}; use --set dist.sync_batchnorm=false (statistics per micro-batch)")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile: its state_dict keys carry no module. or _orig_mod. prefix."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def clip_grad_norm(parameters, max_norm: float, across: dist.ProcessGroup | None = None) -> torch.Tensor:
    """torch's clip_grad_norm_, also for parameters on several device meshes (tensor parallel's layers beside the
    norms FSDP alone shards), where one stack of norms is refused: one norm per mesh made whole (a collective per
    mesh, in parameter order, so the same on every rank), combined, then every group scaled by the same factor.
    across: the group of ranks holding the model's other parts (pipeline stages), whose norms combine with this one."""
    from torch.distributed.tensor.experimental import implicit_replication

    groups: dict = {}  # the gradients' mesh (None: plain tensors) -> parameters
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    if len(groups) <= 1 and across is None:
        return nn.utils.clip_grad_norm_([p for group in groups.values() for p in group], max_norm)
    device = next(iter(groups.values()))[0].grad.device if groups else torch.device("cpu")
    whole = [_mesh_norm([p.grad for p in group]) for group in groups.values()] or [torch.zeros((), device=device)]
    total = torch.linalg.vector_norm(torch.stack(whole))
    if across is not None:  # the squares summed over the stages: the norm of every parameter of the model
        squared = total.float() ** 2
        dist.all_reduce(squared, group=across)
        total = squared.sqrt()
    with implicit_replication():  # the plain total norm scales DTensor gradients as a replicated value
        for group in groups.values():
            nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _mesh_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of gradients on one mesh (plain tensors: torch's), whole on every rank of it: each rank's squares of
    its shards summed over the mesh dimensions they are split along (not those they are replicated over), one
    dimension at a time. torch's own DTensor norm merges the reductions of several dimensions into one over their
    flattened mesh, and refuses (KeyError) a mesh whose dimensions are not in the root mesh's order: the experts'
    (shard_mod_ep_cp, ep) under expert x context parallel. Every rank of a mesh holds the same parameters' shards,
    so the same reductions, in the same order."""
    if not isinstance(grads[0], DTensor):
        return nn.utils.get_total_norm(grads)
    split: dict[tuple[int, ...], list[torch.Tensor]] = {}  # the dimensions a gradient is split along -> its shards
    for grad in grads:
        split.setdefault(tuple(dim for dim, placement in enumerate(grad.placements)
                               if not placement.is_replicate()), []).append(grad.to_local())
    squares = []
    for dims, shards in sorted(split.items()):
        square = nn.utils.get_total_norm(shards).float() ** 2
        for dim in dims:
            dist.all_reduce(square, group=grads[0].device_mesh.get_group(dim))
        squares.append(square)
    return torch.stack(squares).sum().sqrt()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def state_parts(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                planned: bool = False) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds on `device` (local shards of DTensors).
    Gradients are counted as one per trainable parameter, same shard and dtype: they live from each backward to
    zero_grad, so at the peak of every step. planned: a model on the meta device (distrib plan), whose meta
    tensors stand for `device`'s."""
    def on_device(tensor: torch.Tensor) -> int:
        part = local_tensor(tensor)
        here = _same_device(part, device) or (planned and part.device.type == "meta")
        return part.numel() * part.element_size() if here else 0

    params = list(model.parameters())
    return {"parameters": sum(on_device(p) for p in params),
            "gradients": sum(on_device(p) for p in params if p.requires_grad),
            "optimizer": sum(on_device(value) for state in optimizer.state.values() for value in state.values()
                             if isinstance(value, torch.Tensor))}


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    return sum(state_parts(model, optimizer, device).values())


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime) -> dict:
    """state_bytes_per_rank and peak_memory_bytes (None where the device has no allocator statistics): the largest
    over ranks. A collective."""
    peak = runtime.peak_memory_bytes()
    stats = torch.tensor([state_bytes(model, optimizer, runtime.device), peak or 0], device=runtime.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    largest_state, largest_peak = stats.tolist()
    return {"state_bytes_per_rank": largest_state, "peak_memory_bytes": largest_peak if peak is not None else None}

