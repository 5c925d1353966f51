"""The pipeline's step runner (dist.pipeline_parallel > 1): the one owner of this rank's stages. It lays them out (cut,
viewed, parallelized: lay_out), runs each micro-step through torch's schedule, and answers where a gradient norm, a
forward-only pass or a gathered state differ from one whole model's; the Pipelined module it returns is handed the
same Pipeline for its forward-only passes (evaluation, prediction, the pre-flight batch)."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed.dimensions.pipeline import microbatches
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import explain_device_errors
from distrib.distributed.pipeline.layout import check_micro_batch, lay_out
from distrib.distributed.pipeline.stages import Pipeline
from distrib.distributed.runner import GradSync, Runner
from distrib.distributed.runtime import Runtime
from distrib.distributed.step_inputs import handed_alone, stepping
from distrib.errors import UserError


class PipelineRunner(Runner):
    """This rank's stages, run by the schedule dist.pipeline_schedule names: `pipeline`, made by lay_out (None
    before: the micro-batch check runs first)."""

    logs_extra_losses = False  # the last stage's loss sees its microbatches' outputs only
    holds_part = True

    def __init__(self, config: DistConfig, dims: ParallelDims):
        self.config, self.dims = config, dims
        self.pipeline: Pipeline | None = None

    def check_micro_batch(self, micro_batch_size: int) -> None:
        check_micro_batch(self.config, micro_batch_size)

    def lay_out(self, whole: nn.Module, dims: ParallelDims, config: DistConfig, runtime: Runtime, *,
                speed: SpeedConfig, precision: str, log: Callable[[str], None]) -> nn.Module:
        """runtime.rank's stages of `whole` (distrib plan lays out each pipeline rank's in turn): a Pipelined module
        whose parameters the optimizer and checkpoints see."""
        held, self.pipeline = lay_out(whole, dims, config, runtime, speed=speed, precision=precision, log=log)
        held.pipeline = self.pipeline  # for its forward-only passes, and the whole model's names (model.init_from)
        return held

    @property
    def stages(self) -> dict[int, nn.Module]:
        """This rank's stages, by index: {stage: its view (an FSDP root once sharded)}."""
        return self.pipeline.stages

    def describe(self) -> list[str]:
        config = self.config
        return [f"pipeline parallel: {self.dims.pipeline} ranks x {config.stages_per_rank} stage(s) each, schedule "
                f"{config.pipeline_schedule}, {microbatches(config)} microbatches per micro-step; this rank holds "
                f"{self.pipeline.describe()}: no rank held the model whole"]

    def forward_backward(self, model: nn.Module, micro_batches: list, step, grad_sync: GradSync) -> torch.Tensor:
        """Each micro-batch, as the degrees cut it for this rank (context parallel: its chunks of every window), through
        the schedule, cut into microbatches; no grad_sync: the schedule's stages reduce their gradients after their
        last backward. Packed documents' positions (and cp's attention) reach the stages from the step (one_tensor).
        The sum of this rank's microbatch losses (0 off the last stage)."""
        total = torch.zeros((), device=step.device)
        pieces = self.pipeline.microbatches
        for inputs, targets in micro_batches:
            if not (isinstance(inputs, torch.Tensor) or handed_alone(inputs) and self.pipeline.reads_positions):
                raise UserError("dist.pipeline_parallel > 1: the samples' inputs are not one tensor (nor token ids "
                                "with the positions of packed documents into the built-in GPT or a transformers "
                                "decoder), and a pipeline cuts one tensor into microbatches; use --set "
                                "dist.pipeline_parallel=1")
            inputs, targets = self.cut((inputs, targets))
            with explain_device_errors(model, step.device, step.batch(inputs, targets)), step.autocast(), \
                    one_tensor(inputs, pieces) as tokens:
                loss = self.pipeline.train_step(tokens, targets, lambda out, tgt: step.loss(out, tgt, pieces))
            if loss is not None:
                total = total + loss
        return total

    @property
    def norm_group(self) -> dist.ProcessGroup:
        return self.pipeline.group  # every stage's part of the norm

    def roots(self, model: nn.Module) -> list[nn.Module]:
        return list(self.pipeline.stages.values())

    def full_model_state(self, model: nn.Module) -> dict:
        return self.pipeline.whole_on_rank0(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))

    def whole_on_rank0(self, state: dict) -> dict:
        return self.pipeline.whole_on_rank0(state)

    def complete(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.pipeline.complete(tensors)

    def check_one_file_state(self) -> None:
        raise UserError("a one-file (ddp) checkpoint cannot be resumed under dist.pipeline_parallel > 1 (its "
                        "optimizer state is keyed by the whole model's parameter order); resume it under ddp or "
                        "fsdp once, then under pipeline parallel from that run's (sharded) checkpoint")


def one_tensor(inputs, microbatches: int = 1) -> contextlib.AbstractContextManager:
    """Inside: the one tensor the schedule cuts into microbatches and the first stage takes; what else the micro-batch
    holds (packed documents' positions, context parallel's positions and attention) reaches every stage's forward
    from the step, each microbatch's rows (the step's schedule, and distrib plan's stage passes)."""
    if handed_alone(inputs):
        return stepping(inputs, microbatches)
    return contextlib.nullcontext(inputs)
