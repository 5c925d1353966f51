"""Pipeline parallel (dist.pipeline_parallel > 1), one degree of the mesh: the model is built on meta, cut into stages
(split), this rank's stages laid out by the one parallelize (tensor parallel, checkpointing, compile, FSDP2 on each
stage over its data-parallel ranks: ddp's is a (replicate, shard 1) mesh), and run by torch's schedules (stages).
Its state is DTensors saved shard by shard under the whole model's names: any layout reads the checkpoint.

The mechanism lives here (its keys and rules are declared in distrib.distributed.dimensions.pipeline): lay_out
(layout), and the step runner (runner), the one owner of this rank's stages, which the strategy holding the model asks
where a step, a gradient norm or a gathered state differ from one whole model's."""

from __future__ import annotations

from distrib.config import DistConfig
from distrib.distributed.dimensions.pipeline import microbatches
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.pipeline.decoder import stage_class
from distrib.distributed.pipeline.layout import check_micro_batch, lay_out
from distrib.distributed.pipeline.runner import PipelineRunner
from distrib.distributed.pipeline.split import StageSplit, owner_of, pipeline_units, split_stages, stages_of, view
from distrib.distributed.pipeline.stages import Pipeline, Pipelined
from distrib.distributed.runner import Runner


def runner_for(config: DistConfig, dims: ParallelDims) -> Runner:
    """The step runner of this layout, chosen once (before the model is built: the micro-batch checks ask it): a
    pipeline's schedule over this rank's stages, or the plain step."""
    return PipelineRunner(config, dims) if dims.pipeline > 1 else Runner(dims)


__all__ = ["Pipeline", "PipelineRunner", "Pipelined", "StageSplit", "check_micro_batch", "lay_out", "microbatches",
           "owner_of", "pipeline_units", "runner_for", "split_stages", "stage_class", "stages_of", "view"]
