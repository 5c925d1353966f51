"""Pipeline parallel's layout: its config rules (check_keys), its microbatches, and lay_out, which cuts the model into
stages, views this rank's and lays them out by the one parallelize (each stage an FSDP root)."""

from __future__ import annotations

from typing import Callable, NoReturn

import torch.nn as nn

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallelize import parallelize
from distrib.distributed.pipeline.decoder import stage_class
from distrib.distributed.pipeline.split import refuse_ties, split_stages, stages_of, view
from distrib.distributed.pipeline.stages import Pipeline, Pipelined, pipelined_view
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError


def _refuse(key: str, value, why: str, fix: str) -> NoReturn:
    raise ConfigError(f"dist.{key} = {value!r}: {why}; {fix}")


def check_keys(config: DistConfig) -> None:
    """A one-line ConfigError for a schedule, or a key, a pipeline cannot run (before any worker starts)."""
    schedule, per_rank = config.pipeline_schedule, config.stages_per_rank
    if schedule in ("zbv", "dualpipev"):
        # Measured: the built-in GPT at pp 2 (ddp or fsdp) trained to test loss 5.25 (zbv) and 4.068 (dualpipev)
        # after 12 steps where one process and every other schedule reach 4.0716: torch's split of the backward
        # into input and weight gradients does not give the same gradients here.
        _refuse("pipeline_schedule", schedule, "runs under torch 2.14 but does not train the same model as one "
                "process (its split backward, measured on gloo: docs/parallelism.md, Pipeline parallelism)",
                "use --set dist.pipeline_schedule=interleaved_1f1b (or 1f1b)")
    if schedule in ("gpipe", "1f1b") and per_rank != 1:
        _refuse("pipeline_stages_per_rank", per_rank, f"the {schedule} schedule runs one stage per rank",
                "set --set dist.pipeline_schedule=interleaved_1f1b, or dist.pipeline_stages_per_rank=1")
    if schedule == "interleaved_1f1b" and per_rank < 2:
        _refuse("pipeline_stages_per_rank", per_rank, "interleaved_1f1b interleaves several stages per rank",
                "set --set dist.pipeline_stages_per_rank=2 (or 0), or dist.pipeline_schedule=1f1b")
    if config.cpu_offload:
        _refuse("cpu_offload", config.cpu_offload, "is not supported with dist.pipeline_parallel > 1 (each stage's "
                "shards stay on its device)", "set --set dist.cpu_offload=false")
    if config.sync_batchnorm:
        _refuse("sync_batchnorm", config.sync_batchnorm, "is not supported with dist.pipeline_parallel > 1",
                "set --set dist.sync_batchnorm=false")


def microbatches(config: DistConfig) -> int:
    """How many microbatches each micro-step is cut into: dist.pipeline_microbatches, or one per stage."""
    return config.pipeline_microbatches or config.pipeline_parallel * config.stages_per_rank


def check_micro_batch(config: DistConfig, micro_batch_size: int) -> None:
    count = microbatches(config)
    if micro_batch_size % count:
        raise ConfigError(f"dist.pipeline_microbatches = {count}: does not divide the micro-batch of "
                          f"{micro_batch_size} samples each data-parallel rank trains on per micro-step; use a "
                          f"divisor of {micro_batch_size}, or change train.global_batch_size")


def lay_out(whole: nn.Module, dims: ParallelDims, config: DistConfig, runtime: Runtime, *,
            speed: SpeedConfig = SpeedConfig(), precision: str = "fp32", log: Callable[[str], None] = print
            ) -> tuple[Pipelined, Pipeline]:
    """runtime.rank's stages of `whole` (distrib plan asks for each pipeline rank's), cut and viewed, then laid out by
    the one parallelize with each stage an FSDP root: the Pipelined module that holds them (what the optimizer and
    checkpoints see), and the Pipeline that runs them (the runner's). dims.mesh must be built."""
    pp = dims.pipeline
    split = split_stages(whole, pp * config.stages_per_rank, config.pipeline_split, pp)
    refuse_ties(whole, split, pp)
    names = list(whole.state_dict())  # the whole model's, in its order: what model.pt holds
    mine = stages_of(dims.pipeline_rank(runtime.rank), pp, config.stages_per_rank, config.pipeline_schedule)
    held = pipelined_view(whole, split.units, {unit for stage in mine for unit in split.stage_units(stage)})
    cls = stage_class(whole)  # a Hugging Face decoder's stage runs its units itself; other models' forward does
    views = {stage: view(whole, split.units, set(split.stage_units(stage)), cls) for stage in mine}
    parallelize(held, dims, config, runtime, speed=speed, precision=precision, log=log, roots=list(views.values()))
    return held, Pipeline(split, views, dims.mesh["pp"].get_group(), dims, config.pipeline_schedule,
                          microbatches(config), runtime.device, whole, names)
