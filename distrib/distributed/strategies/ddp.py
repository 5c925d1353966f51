"""The ddp strategy: every rank builds and holds the whole model (on the host, then on its device), DDP all-reduces
the gradients in buckets during the last micro-step's backward (the one parallelize wraps it), and rank 0 alone
writes the whole state to one file."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed import fsdp, unused
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import place_model, unwrap
from distrib.distributed.parallelize import parallelize
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies.base import Build, StepLoss, Strategy
from distrib.distributed.strategies.materialise import build_whole
from distrib.errors import UserError

# torch's words when a step starts while the previous one's gradient reduction waits for a parameter's gradient.
_UNFINISHED = "Expected to have finished reduction in the prior iteration"


def _said(setting: bool | str) -> str:
    return setting if isinstance(setting, str) else str(setting).lower()


class DDPStrategy(Strategy):
    names = ("ddp",)
    sharded_state = False

    def __init__(self, config: DistConfig = DistConfig(), dims: ParallelDims | None = None):
        super().__init__(config, dims or ParallelDims.replicas(1))

    @classmethod
    def replicas_and_shards(cls, config: DistConfig, data_parallel: int, world_size: int,
                            local_world_size: int) -> tuple[int, int]:
        return data_parallel, 1  # every data-parallel rank a whole replica

    def setup_trained(self, model: nn.Module, runtime: Runtime, speed: SpeedConfig) -> nn.Module:
        return parallelize(place_model(model, runtime.device), self.dims, self.config, runtime, speed=speed)

    def setup_module(self, build: Build, runtime: Runtime) -> nn.Module:
        model = build.given if build.given is not None else build_whole(build.factory, build.seed)
        if build.load_weights is not None:
            build.load_weights(model)
        model = place_model(model, runtime.device)
        # Before DDP: its hooks are set per parameter when it wraps, and a parameter without a gradient in a step
        # leaves its reduction unfinished unless DDP looks for such parameters (a collective under auto).
        find = unused.find_unused(self.config.find_unused_parameters, model, build.dry_forward, runtime.device,
                                  build.log)
        return parallelize(model, self.dims, self.config, runtime, speed=build.speed, precision=build.precision,
                           log=build.log, find_unused_parameters=find)

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
