"""The ddp strategy: every rank builds and holds the whole model (on the host, then on its device), DDP all-reduces
the gradients in buckets during the last micro-step's backward, and rank 0 alone writes the whole state to one file."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed import fsdp, unused
from distrib.distributed.compile import compile_whole
from distrib.distributed.mesh import ParallelDims, group_split
from distrib.distributed.parallel import place_model, unwrap
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies.base import Build, StepLoss, Strategy
from distrib.distributed.strategies.materialise import build_whole
from distrib.errors import ConfigError, UserError

# torch's words when a step starts while the previous one's gradient reduction waits for a parameter's gradient.
_UNFINISHED = "Expected to have finished reduction in the prior iteration"


def _said(setting: bool | str) -> str:
    return setting if isinstance(setting, str) else str(setting).lower()


def wrap_ddp(model: nn.Module, runtime: Runtime, **options) -> DDP:
    """DDP over a model already on the worker's device; rank 0's initial weights are broadcast to all ranks."""
    return DDP(model, device_ids=runtime.ddp_device_ids, **options)


def _inputs_channels_last(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.contiguous(memory_format=torch.channels_last) if isinstance(a, torch.Tensor) and a.dim() == 4
                 else a for a in args)


def prepare(model: nn.Module, speed: SpeedConfig, shard_modules) -> None:
    """The [speed] options that change the module itself, before any wrapping: channels_last and activation
    checkpointing (both also work on a model still on the meta device)."""
    if speed.channels_last:
        model.to(memory_format=torch.channels_last)
        model.register_forward_pre_hook(_inputs_channels_last)  # inputs follow, whoever feeds the model
    if speed.activation_checkpointing == "blocks":
        fsdp.checkpoint_activations(model, shard_modules)


def wrap(model: nn.Module, runtime: Runtime, speed: SpeedConfig, shard_modules="auto",
         log: Callable[[str], None] = lambda line: None, find_unused_parameters: bool = False) -> nn.Module:
    """A placed whole model made ready to train or evaluate as ddp: the [speed] options, DDP, torch.compile (over
    DDP: distrib.distributed.compile.compile_whole, whose line goes to `log`). What distrib eval and predict run too."""
    prepare(model, speed, shard_modules)
    wrapped = wrap_ddp(model, runtime, gradient_as_bucket_view=speed.gradient_as_bucket_view,
                       static_graph=speed.static_graph, bucket_cap_mb=speed.bucket_cap_mb or None,
                       find_unused_parameters=find_unused_parameters)
    if not speed.compile:
        return wrapped
    wrapped, line = compile_whole(wrapped, speed)
    log(line)
    return wrapped


class DDPStrategy(Strategy):
    names = ("ddp",)
    sharded_state = False

    def __init__(self, config: DistConfig = DistConfig(), dims: ParallelDims = ParallelDims("ddp", 1, 1)):
        super().__init__(config, dims)

    @classmethod
    def check_keys(cls, config: DistConfig) -> None:
        if config.cpu_offload:
            raise ConfigError(f"dist.cpu_offload = {config.cpu_offload}: offloads FSDP shards, and dist.strategy is "
                              "ddp; set --set dist.strategy=fsdp or --set dist.cpu_offload=false")
        super().check_keys(config)
        if config.tensor_parallel > 1:
            raise ConfigError(f"dist.tensor_parallel = {config.tensor_parallel}: composes with fsdp or hsdp on the "
                              "data-parallel ranks, and dist.strategy is ddp; set --set dist.strategy=fsdp (or hsdp)")

    @classmethod
    def replicas_and_shards(cls, config: DistConfig, data_parallel: int, world_size: int,
                            local_world_size: int) -> tuple[int, int]:
        return data_parallel, 1  # every data-parallel rank a whole replica

    def setup_trained(self, model: nn.Module, runtime: Runtime, speed: SpeedConfig) -> nn.Module:
        return wrap(place_model(model, runtime.device), runtime, speed, self.config.shard_modules)

    def setup_module(self, build: Build, runtime: Runtime) -> nn.Module:
        model = build.given if build.given is not None else build_whole(build.factory, build.seed)
        if build.load_weights is not None:
            build.load_weights(model)
        model = place_model(model, runtime.device)
        # Before DDP: its hooks are set per parameter when it wraps, and a parameter without a gradient in a step
        # leaves its reduction unfinished unless DDP looks for such parameters (a collective under auto).
        find = unused.find_unused(self.config.find_unused_parameters, model, build.dry_forward, runtime.device,
                                  build.log)
        return wrap(model, runtime, build.speed, self.config.shard_modules, build.log, find)

    def forward_backward(self, model: nn.Module, micro_batches: list, step: StepLoss) -> torch.Tensor:
        try:
            return super().forward_backward(model, micro_batches, step)
        except RuntimeError as e:
            if _UNFINISHED not in str(e):
                raise
            # On every rank alike (each finds its own reduction unfinished), and at the step after the one at fault.
            raise UserError(f"dist.find_unused_parameters = {_said(self.config.find_unused_parameters)}: a trainable "
                            "parameter got no gradient in the previous step (an expert no token reached, a branch "
                            "not taken), and DDP waited for it; fix: --set dist.find_unused_parameters=true") from None

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        wrapped = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
        # DDP decides in the forward whether to all-reduce, hence around forward and backward both.
        return wrapped.no_sync() if not enabled and isinstance(wrapped, DDP) else contextlib.nullcontext()

    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, named: bool = False) -> dict:
        if named:  # the parameter-name view a sharded checkpoint is loaded into
            return fsdp.sharded_state(unwrap(model), optimizer)
        return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if fsdp.keyed_by_name(state["optimizer"]):  # a sharded checkpoint, gathered whole by DCP
            fsdp.load_sharded_state(unwrap(model), optimizer, state)
        else:
            unwrap(model).load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

    def full_model_state(self, model: nn.Module) -> dict:
        return unwrap(model).state_dict()

    def step_traffic(self, per_node: int, local_params: int, compute_bytes: int, grad_accum: int,
                     reshard_after_forward: bool, tp_activation_bytes: float = 0) -> tuple[float, float]:
        # one all-reduce of the fp32 gradients per step
        return group_split(self.dims.replicate, 1, per_node, local_params * 4, 2)

    def startup_memory(self, parameter_bytes_per_rank: int, whole_bytes: int, largest_tensor_bytes: int,
                       self_initialising: bool, nproc_per_node: int, params_on_host: bool) -> tuple[int, int]:
        # Every rank builds the whole model on its host, then moves it to its device tensor by tensor.
        return whole_bytes, nproc_per_node * whole_bytes
