"""The step runner: how one optimizer step's micro-batches run on this rank's model, chosen once per run (by
distrib.distributed.pipeline.runner_for): the plain step here (forward and backward of each micro-batch, gradients
synced in the last), or a pipeline schedule over this rank's stages (distrib.distributed.pipeline.runner).

A strategy holds its runner and asks it wherever a step, a gradient norm, a forward-only pass or a gathered state
differ with the way the model runs; distrib plan and its dry run ask it for the modules that run (`roots`, `stages`).
The runner lays the model out (`lay_out`), so that what runs and what it runs on have one owner."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed import dimensions, fsdp
from distrib.distributed.compile import explain_compile_errors
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import explain_device_errors, unwrap
from distrib.distributed.parallelize import parallelize
from distrib.distributed.runtime import Runtime

# (model, enabled) -> the context of a micro-step's forward and backward: the strategy's (DDP's no_sync, FSDP's
# requires_gradient_sync), enabled in a step's last micro-step only.
GradSync = Callable[[nn.Module, bool], contextlib.AbstractContextManager]


def zero_missing_grads(model: nn.Module) -> None:
    """A zero gradient for each trainable parameter that got none in the step (an expert no token reached on any rank):
    what FSDP2 reduces for them (set_reduce_scatter_unused_params), so that every strategy and world size steps the
    same parameters, and an optimizer's momentum and weight decay act alike on them."""
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)


class Runner:
    """The plain step: every micro-batch forwarded and backwarded by this rank's whole (laid out) model. Each hook
    here is what a runner that runs the model otherwise (a pipeline's schedule) replaces."""

    # Whether the trainer's loss sees each micro-batch's outputs whole, so that the model's extra losses are logged
    # (not under pipeline parallel, whose last stage sees its microbatches' outputs only).
    logs_extra_losses: bool = True
    # Whether this rank's model is a part of the whole (a pipeline rank's stages): materialise's fill from rank 0.
    holds_part: bool = False

    def __init__(self, dims: ParallelDims | None = None):
        self.dims = dims  # the run's degrees: each cuts a micro-batch for this rank (dimensions.transform_batch)

    def check_micro_batch(self, micro_batch_size: int) -> None:
        """A one-line ConfigError if micro-batches of this size cannot run (a pipeline cuts each into microbatches)."""

    def lay_out(self, whole: nn.Module, dims: ParallelDims, config: DistConfig, runtime: Runtime, *,
                speed: SpeedConfig, precision: str, log: Callable[[str], None]) -> nn.Module:
        """The model this rank runs, laid out by the one parallelize (dims.mesh built): the whole model."""
        return parallelize(whole, dims, config, runtime, speed=speed, precision=precision, log=log)

    def describe(self) -> list[str]:
        """The start-up log's lines about how the model runs (none for the plain step)."""
        return []

    def forward_backward(self, model: nn.Module, micro_batches: list, step, grad_sync: GradSync) -> torch.Tensor:
        """The forward and backward of one optimizer step's micro-batches (step: a strategies.base.StepLoss),
        gradients synced in the last; returns this rank's share of the step's loss (the sum of what it
        backwarded)."""
        losses = []
        for index, batch in enumerate(micro_batches):
            inputs, targets = self.cut(batch)
            with grad_sync(model, index == len(micro_batches) - 1), explain_compile_errors(model), \
                    explain_device_errors(model, step.device, step.batch(inputs, targets)):
                with step.autocast():  # DDP decides in the forward whether to sync: forward and backward inside
                    loss = step.loss(step.forward(model, inputs), targets, 1)
                step.backward(loss)
            losses.append(loss.detach())
        zero_missing_grads(model)
        return torch.stack(losses).sum()

    def cut(self, batch: tuple) -> tuple:
        """A micro-batch (inputs, targets) as the run's degrees hand it to this rank's forward."""
        if self.dims is None:
            return batch
        return dimensions.transform_batch(batch, self.dims, dist.get_rank() if dist.is_initialized() else 0)

    def loss_shares(self, world_size: int) -> int:
        """How many shares a step's loss is normalised into (losses.step_loss): world_size, times what the degrees
        cut a micro-batch into (dimensions.loss_count)."""
        return world_size if self.dims is None else dimensions.loss_count(world_size, self.dims)

    @property
    def norm_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold other parts of the gradient norm beside the model's own meshes (None: none)."""
        return None

    def roots(self, model: nn.Module) -> list[nn.Module]:
        """The modules that run in place of the model: its FSDP roots under a sharded strategy (a forward-only pass
        leaves them gathered; the dry run's tracker instruments them)."""
        return [unwrap(model)]

    def full_model_state(self, model: nn.Module) -> dict:
        """A sharded model's whole plain state_dict on rank 0 ({} on the others): a collective of every rank."""
        return fsdp.full_model_state(unwrap(model))

    def whole_on_rank0(self, state: dict) -> dict:
        """A state_dict made whole on each rank that holds a part (an EMA's) as rank 0's: as it is, but under
        pipeline parallel, whose stages send theirs to rank 0. A collective."""
        return state

    def complete(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's tensors under every name of the whole model, as the weights files lay them out on every rank:
        as they are, but under pipeline parallel (the other stages' as meta tensors)."""
        return tensors

    def check_one_file_state(self) -> None:
        """A one-line UserError if a one-file (ddp) checkpoint, whose optimizer state is keyed by the whole model's
        parameter order, cannot be resumed into this model."""
