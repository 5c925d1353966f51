"""One parallelize: how a layout is applied to a model, or to one pipeline rank's stages of it, always in the same
order (torchtitan's): the declared degrees' steps at their places (distrib.distributed.dimensions: tensor parallel ->
expert parallel -> data parallel, FSDP2's fully_shard or DDP), with activation checkpointing and channels_last, which
change the module itself, before data parallel. Each step reads its degree from the run's ParallelDims and its
submesh from the one mesh; a new dimension declares its step in its own module (docs/layouts.md).

Tensor parallel comes first so that FSDP shards the tensor-parallel slices, expert parallel before FSDP so that FSDP
shards each rank's experts (units of their own, over what remains of the shard group); blocks are compiled before
fully_shard so that FSDP's hooks stay outside the compiled graphs; DDP is compiled whole over its wrapper instead
(dynamo splits the graphs at its gradient buckets, so that the all-reduce overlaps the backward)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed import dimensions, fsdp
from distrib.distributed.dimensions import Layout
from distrib.distributed.dimensions.data import replicate, wrap_ddp
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime


def parallelize(model: nn.Module, dims: ParallelDims, config: DistConfig, runtime: Runtime, *,
                speed: SpeedConfig = SpeedConfig(), precision: str = "fp32", log: Callable[[str], None] = print,
                roots: list[nn.Module] | None = None, find_unused_parameters: bool = False) -> nn.Module:
    """The model laid out over dims: split by tensor parallel, its experts by expert parallel, its blocks checkpointed
    and compiled, then sharded (fully_shard: a model on the meta device, materialised afterwards; the experts over
    what expert parallel leaves of the shard group) or wrapped by DDP (a placed model). roots: the
    modules that run in place of the model (one pipeline rank's stages, views of it), FSDP roots of their own. distrib
    plan calls it with the default speed options (it sizes the state: nothing compiled)."""
    layout = Layout(dims, config, runtime, speed, precision, log, roots, find_unused_parameters)
    for step in dimensions.parallelize_steps(dims, _prepare):
        model = step(model, layout)
    return model


def _prepare(model: nn.Module, layout: Layout) -> nn.Module:
    prepare(model, layout.speed, layout.config.shard_modules)
    return model


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


__all__ = ["parallelize", "prepare", "replicate", "wrap_ddp"]
