"""Pipeline parallel's layout: lay_out cuts the model into stages, views this rank's and lays them out by the one
parallelize (each stage an FSDP root); check_micro_batch refuses a micro-batch the microbatches do not divide. The
degree's keys, their rules and its microbatches are declared in distrib.distributed.dimensions.pipeline."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed.dimensions.pipeline import microbatches
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallelize import parallelize
from distrib.distributed.pipeline.decoder import stage_class
from distrib.distributed.pipeline.split import refuse_ties, split_stages, stages_of, view
from distrib.distributed.pipeline.stages import Pipeline, Pipelined, pipelined_view
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError


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
