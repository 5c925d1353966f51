"""Model placement and data parallelism: .to(device) with device-mismatch diagnostics, then DDP; unwrap; grad sync.

A mismatch error names every parameter, buffer or batch tensor that is off the worker's device, and where it is."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distrib.config import SpeedConfig
from distrib.errors import DeviceMismatchError, UserError
from distrib.runtime import Runtime

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


def _mismatch(found: list[str], device: torch.device, fix: str) -> DeviceMismatchError:
    more = len(found) - _MAX_LISTED
    listed = "; ".join(found[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")
    return DeviceMismatchError(f"device mismatch, expected {device} (this worker's device): {listed}; fix: {fix}")


def place_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Moves the model to the worker's device and proves that every parameter and buffer arrived."""
    on_meta = [m for m in misplaced_tensors(model, device) if m.endswith(" is on meta")]
    if on_meta:  # .to() cannot move a meta tensor: it has no data
        raise _mismatch(on_meta, device, "materialise meta tensors in the model factory "
                                         "(module.to_empty(device=...) then initialise) before returning the model")
    model.to(device)
    found = misplaced_tensors(model, device)
    if found:
        raise _mismatch(found, device, "register these tensors with nn.Parameter or register_buffer so that "
                                       "model.to(device) moves them, and do not pin them to a device")
    return model


def check_batch(batch: dict[str, torch.Tensor], device: torch.device) -> None:
    found = misplaced_tensors(nn.Module(), device, batch)
    if found:
        raise _mismatch(found, device, "move each batch tensor with .to(device) before the forward pass")


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
        raise _mismatch(found, device, f"create tensors inside forward() with device=input.device "
                                       f"(PyTorch said: {first_line})") from e


def sync_batchnorm(model: nn.Module, runtime: Runtime) -> nn.Module:
    """dist.sync_batchnorm: BatchNorm statistics over each micro-step's global batch, with an all-reduce per layer in
    every forward (torch's SyncBatchNorm, which runs on GPUs only)."""
    if not runtime.has_sync_batchnorm:
        raise UserError(f"dist.sync_batchnorm = true: torch's SyncBatchNorm runs on GPUs only, and this worker's "
                        f"device is {runtime.device}; use --set dist.sync_batchnorm=false (statistics per micro-batch)")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def wrap_ddp(model: nn.Module, runtime: Runtime, **options) -> DDP:
    """DDP over a model already on the worker's device; rank 0's initial weights are broadcast to all ranks."""
    return DDP(model, device_ids=runtime.ddp_device_ids, **options)


def _inputs_channels_last(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4
                 else a for a in args)


def parallelize(model: nn.Module, runtime: Runtime, speed: SpeedConfig) -> nn.Module:
    """A placed model made ready to train with the [speed] options: channels_last, DDP, then torch.compile.
    Compiling the DDP module (not the reverse) lets dynamo split graphs at DDP's buckets, so all-reduce overlaps."""
    if speed.channels_last:
        model.to(memory_format=torch.channels_last)
        model.register_forward_pre_hook(_inputs_channels_last)  # inputs follow, whoever feeds the model
    ddp = wrap_ddp(model, runtime, gradient_as_bucket_view=speed.gradient_as_bucket_view,
                   static_graph=speed.static_graph, bucket_cap_mb=speed.bucket_cap_mb or None)
    return torch.compile(ddp, mode=speed.compile_mode) if speed.compile else ddp


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile: its state_dict keys carry no module. or _orig_mod. prefix."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def grad_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Wrap the whole forward AND backward of a micro-step: DDP decides in the forward whether to all-reduce."""
    ddp = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
    if enabled or not isinstance(ddp, DDP):
        return contextlib.nullcontext()
    return ddp.no_sync()

