"""Model placement and data parallelism: .to(device) with device-mismatch diagnostics, then DDP or FSDP2 (see
distrib.fsdp); unwrap; grad sync; the state dicts and memory of either strategy.

A mismatch error names every parameter, buffer or batch tensor that is off the worker's device, and where it is."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed import fsdp
from distrib.distributed.mesh import build_mesh, mesh_shape
from distrib.distributed.runtime import Runtime
from distrib.distributed.tensor_parallel import apply_tensor_parallel
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


def parallelize(model: nn.Module, runtime: Runtime, speed: SpeedConfig, strategy: DistConfig = DistConfig(),
                precision: str = "fp32") -> nn.Module:
    """A placed model made ready to train with the [speed] options: channels_last, activation checkpointing, DDP or
    FSDP2 (dist.strategy), then torch.compile. Compiling the DDP module (not the reverse) lets dynamo split graphs
    at DDP's buckets, so all-reduce overlaps."""
    if speed.channels_last:
        model.to(memory_format=torch.channels_last)
        model.register_forward_pre_hook(_inputs_channels_last)  # inputs follow, whoever feeds the model
    if speed.activation_checkpointing == "blocks":
        fsdp.checkpoint_activations(model, strategy.shard_modules)
    if strategy.sharded:
        wrapped = shard_on_mesh(model, runtime, strategy, precision, runtime.device.type)
    else:
        wrapped = wrap_ddp(model, runtime, gradient_as_bucket_view=speed.gradient_as_bucket_view,
                           static_graph=speed.static_graph, bucket_cap_mb=speed.bucket_cap_mb or None)
    return torch.compile(wrapped, mode=speed.compile_mode) if speed.compile else wrapped


def shard_on_mesh(model: nn.Module, runtime: Runtime, strategy: DistConfig, precision: str,
                  device_type: str) -> nn.Module:
    """fsdp and hsdp: the run's mesh (device_type explicit: a CPU run on a GPU host, or distrib plan's fake group),
    then FSDP2 over its data-parallel dimensions. distrib plan calls this too, so it predicts what runs do."""
    shape = mesh_shape(strategy, runtime.world_size, runtime.local_world_size)
    mesh = build_mesh(shape, device_type)
    if shape.tensor_parallel > 1:  # first, so that FSDP shards the tensor-parallel slices over the other dimensions
        apply_tensor_parallel(model, mesh["tp"])
    return fsdp.shard(model, runtime, strategy, precision, mesh)


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
    """Wrap the whole forward AND backward of a micro-step: DDP decides in the forward whether to all-reduce; FSDP
    reduce-scatters in the backward unless told not to (it then keeps unsharded gradients until the final one)."""
    wrapped = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP or FSDP module
    if fsdp.is_sharded(wrapped):
        return _fsdp_grad_sync(wrapped, enabled)
    if enabled or not isinstance(wrapped, DDP):
        return contextlib.nullcontext()
    return wrapped.no_sync()


@contextlib.contextmanager
def _fsdp_grad_sync(module, enabled: bool) -> Iterator[None]:
    module.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, also for parameters on several device meshes (tensor parallel's layers beside the
    norms FSDP alone shards), where one stack of norms is refused: one norm per mesh made whole (a collective per
    mesh, in parameter order, so the same on every rank), combined, then every group scaled by the same factor."""
    from torch.distributed.tensor.experimental import implicit_replication

    groups: dict = {}  # the gradients' mesh (None: plain tensors) -> parameters
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    if len(groups) <= 1:
        return nn.utils.clip_grad_norm_([p for group in groups.values() for p in group], max_norm)
    norms = [nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    with implicit_replication():  # the plain total norm scales DTensor gradients as a replicated value
        for group in groups.values():
            nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def is_sharded(model: nn.Module) -> bool:
    """Whether each rank holds only a shard of the parameters and gradients (dist.strategy = fsdp)."""
    return fsdp.is_sharded(model)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, named: bool = False) -> dict:
    """{"model", "optimizer"}: whole plain state dicts under DDP (no module. prefix); DTensor shards under FSDP.
    named: the optimizer keyed by parameter names under DDP too (the view a sharded checkpoint is loaded into)."""
    if named or fsdp.is_sharded(model):
        return fsdp.sharded_state(unwrap(model), optimizer)
    return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}


def _keyed_by_name(optimizer_state: dict) -> bool:
    return any(isinstance(key, str) for group in optimizer_state["param_groups"] for key in group["params"])


def load_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Either strategy's state into either strategy's model: both hold the full state (one file: whole tensors on
    every rank; DCP shards: gathered or resharded by DCP to whatever this model holds)."""
    named = _keyed_by_name(state["optimizer"])
    if named:  # a sharded checkpoint, loaded by DCP into this model's own view (shards, or whole tensors)
        fsdp.load_sharded_state(unwrap(model), optimizer, state)
    elif fsdp.is_sharded(model):  # a one-file checkpoint under fsdp: each rank keeps its slices of the whole
        fsdp.load_full_state(unwrap(model), optimizer, state)
    else:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def full_model_state(model: nn.Module) -> dict:
    """What model.pt holds: the whole plain state_dict, the same keys and shapes under either strategy. A collective
    under FSDP (every rank calls it; rank 0 gets the gathered weights, the others {})."""
    return fsdp.full_model_state(unwrap(model)) if fsdp.is_sharded(model) else unwrap(model).state_dict()


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

