"""One parallelize: how a layout is applied to a model, or to one pipeline rank's stages of it, always in the same
order (torchtitan's): tensor parallel -> expert parallel -> activation checkpointing -> compile -> data parallel
(FSDP2's fully_shard, or DDP). Each step reads its degree from the run's ParallelDims and its submesh from the one
mesh; a new dimension is one more step here (docs/layouts.md).

Tensor parallel comes first so that FSDP shards the tensor-parallel slices, expert parallel before FSDP so that FSDP
shards each rank's experts (units of their own, over what remains of the shard group); blocks are compiled before
fully_shard so that FSDP's hooks stay outside the compiled graphs; DDP is compiled whole over its wrapper instead
(dynamo splits the graphs at its gradient buckets, so that the all-reduce overlaps the backward)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed import fsdp
from distrib.distributed.compile import compile_blocks, compile_whole
from distrib.distributed.expert_parallel import apply_expert_parallel
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime
from distrib.distributed.tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, dims: ParallelDims, config: DistConfig, runtime: Runtime, *,
                speed: SpeedConfig = SpeedConfig(), precision: str = "fp32", log: Callable[[str], None] = print,
                roots: list[nn.Module] | None = None, find_unused_parameters: bool = False) -> nn.Module:
    """The model laid out over dims: split by tensor parallel, its experts by expert parallel, its blocks checkpointed
    and compiled, then sharded (fully_shard: a model on the meta device, materialised afterwards; the experts over
    what expert parallel leaves of the shard group) or wrapped by DDP (a placed model). roots: the
    modules that run in place of the model (one pipeline rank's stages, views of it), FSDP roots of their own. distrib
    plan calls it with the default speed options (it sizes the state: nothing compiled)."""
    if dims.tensor_parallel > 1:
        apply_tensor_parallel(model, dims.mesh["tp"], stage=roots is not None)
    experts = None  # each MoE layer's experts split over `ep`, FSDP2 units over the rest of the data-parallel ranks
    if dims.expert_parallel > 1:
        ep, rest = dims.expert_meshes()
        experts = (apply_expert_parallel(model, ep), rest, dims.data_parallel)
    prepare(model, speed, config.shard_modules)
    if not dims.fully_shard:
        return replicate(model, runtime, speed, log, find_unused_parameters)
    if speed.compile:
        log(compile_blocks(model, fsdp.find_blocks(model, config.shard_modules), speed))
    return fsdp.shard(model, runtime, config, precision, dims.data_parallel_mesh(), roots,
                      experts=experts)


def _inputs_channels_last(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4
                 else a for a in args)


def prepare(model: nn.Module, speed: SpeedConfig, shard_modules) -> None:
    """The [speed] options that change the module itself: channels_last and activation checkpointing (both also work
    on a model still on the meta device)."""
    if speed.channels_last:
        model.to(memory_format=torch.channels_last)
        model.register_forward_pre_hook(_inputs_channels_last)  # inputs follow, whoever feeds the model
    if speed.activation_checkpointing == "blocks":
        fsdp.checkpoint_activations(model, shard_modules)


def wrap_ddp(model: nn.Module, runtime: Runtime, **options) -> DDP:
    """DDP over a model already on the worker's device; rank 0's initial weights are broadcast to all ranks."""
    return DDP(model, device_ids=runtime.ddp_device_ids, **options)


def replicate(model: nn.Module, runtime: Runtime, speed: SpeedConfig, log: Callable[[str], None] = lambda line: None,
              find_unused_parameters: bool = False) -> nn.Module:
    """DDP over a placed whole model, then torch.compile over it (compile_whole, whose line goes to `log`)."""
    wrapped = wrap_ddp(model, runtime, gradient_as_bucket_view=speed.gradient_as_bucket_view,
                       static_graph=speed.static_graph, bucket_cap_mb=speed.bucket_cap_mb or None,
                       find_unused_parameters=find_unused_parameters)
    if not speed.compile:
        return wrapped
    wrapped, line = compile_whole(wrapped, speed)
    log(line)
    return wrapped
