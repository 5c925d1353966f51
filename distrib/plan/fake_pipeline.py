"""The dry run's step of a pipeline rank (distrib.plan.dry_run): its stages run directly on fake microbatches of the
shapes a meta pass of the whole model gives, as many in flight as the schedule holds, inside the pipeline runner's
step (packed documents' positions reach every stage as the run hands them)."""

from __future__ import annotations

import torch
import torch.nn as nn

from distrib.config import Config
from distrib.data.batching import BatchPlan
from distrib.distributed import pipeline
from distrib.distributed.pipeline.decoder import stage_class
from distrib.distributed.pipeline.runner import one_tensor
from distrib.distributed.step_inputs import microbatch
from distrib.distributed.strategies import Strategy
from distrib.plan.batch import shaped_batch, staged_inputs
from distrib.plan.fake_step import HOST, cut_to, step_loss_of
from distrib.plan.pipeline import in_flight
from distrib.plan.rank import meta_model


def stage_inputs(config: Config, info, size: int, sample, blocks: int | None = None) -> list[torch.Tensor]:
    """Each stage's input for a microbatch of `size` samples, as meta tensors: the whole model on meta (cut to
    `blocks` where given), forwarded stage by stage (the shapes each stage is given)."""
    dist_config = config.dist
    model = cut_to(meta_model(config, info), config, blocks)
    split = pipeline.split_stages(model, dist_config.pipeline_parallel * dist_config.stages_per_rank,
                                  dist_config.pipeline_split, dist_config.pipeline_parallel)
    cls = stage_class(model)  # as lay_out views the stages (a Hugging Face decoder's run their units themselves)
    staged_inputs(sample, dist_config.pipeline_parallel)
    inputs = []
    with torch.no_grad(), one_tensor(shaped_batch(sample, size)[0]) as x:  # packed documents: positions from the step
        for stage in range(split.num_stages):
            inputs.append(x)
            x = pipeline.view(model, split.units, set(split.stage_units(stage)), cls)(x)
    return inputs


def pipeline_step(config: Config, strategy: Strategy, model: nn.Module, sample, batches: BatchPlan, rank: int,
                  inputs: list[torch.Tensor], next_microbatch, turned) -> None:
    """Each micro-step, this rank's stages on their microbatches as torch's schedule holds them: as many forwarded
    before the first backward as the schedule keeps in flight (distrib.plan.pipeline.in_flight), then the others one
    by one; each stage reduces its gradients in its last backward only (the schedule's no-sync backwards). turned()
    is called at the first micro-step's turns: before its first backward and after each (distrib.plan.blocks)."""
    dist_config, stages = config.dist, strategy.runner.stages
    count = pipeline.microbatches(dist_config)
    mine = pipeline.stages_of(strategy.dims.pipeline_rank(rank), dist_config.pipeline_parallel,
                              dist_config.stages_per_rank, dist_config.pipeline_schedule)
    held = in_flight(dist_config.pipeline_schedule, dist_config.pipeline_parallel, dist_config.stages_per_rank, count,
                     strategy.dims.pipeline_rank(rank))
    batch, targets = shaped_batch(sample, batches.micro_batch_size, HOST)
    step = step_loss_of(config, strategy, [targets] * batches.grad_accum_steps)
    last, forwarded = len(inputs) - 1, dict.fromkeys(mine, 0)

    def forward_one(stage: int) -> torch.Tensor:
        next_microbatch()  # the tracker's per-module figures (not its peak) start again: it takes one pass per module
        received = torch.zeros_like(inputs[stage], device=HOST)
        received.requires_grad_(stage > 0 and received.is_floating_point())
        with step.autocast(), microbatch(forwarded[stage]):  # as the runner's stages: the step's rows of it
            forwarded[stage] += 1
            out = stages[stage](received)
            return step.loss(out, targets[:len(received)], count) if stage == last else out

    def backward_one(stage: int, out: torch.Tensor, done: int) -> None:
        final = done == count - 1
        stages[stage].set_is_last_backward(final)
        stages[stage].set_reshard_after_backward(final)
        stages[stage].set_requires_gradient_sync(final)
        out.backward() if stage == last else out.backward(torch.ones_like(out))

    for micro_step in range(batches.grad_accum_steps):
        forwarded.update(dict.fromkeys(mine, 0))
        with one_tensor(batch, count):  # the runner's: packed documents' positions reach every stage from the step
            _micro_step(mine, held, count, forward_one, backward_one, turned if micro_step == 0 else None)


def _micro_step(mine: list[int], held: list[int], count: int, forward_one, backward_one, turned) -> None:
    """One micro-step of this rank's stages `mine`: `held` microbatches of each forwarded before the first backward,
    then the others one by one; turned() (None: nothing) at the turns, before the first backward and after each."""
    first = turned or (lambda: None)
    pending = [(stage, forward_one(stage)) for stage, kept in zip(mine, held) for _ in range(kept)]
    first()
    done = dict.fromkeys(mine, 0)
    for stage, out in pending:
        backward_one(stage, out, done[stage])
        done[stage] += 1
        first()
    for stage, kept in zip(mine, held):
        for _ in range(count - kept):
            backward_one(stage, forward_one(stage), done[stage])
            done[stage] += 1
            first()
