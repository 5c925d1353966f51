"""Pipeline parallel's declaration (dist.pipeline_parallel and its schedule's keys): its rules, its share of the
world, its `pp` mesh dimension (outermost: one activation per microbatch between neighbours, the least traffic), its
words and its microbatches, which the plan counts. How it cuts the model and runs a step is the mechanism's
(distrib.distributed.pipeline); this module imports none of it, since that package lays its stages out through
parallelize, which iterates over the declared degrees."""

from __future__ import annotations

from typing import NoReturn

from distrib.config import Config, DistConfig
from distrib.distributed.dimensions.base import Dimension, Mesh, Words
from distrib.distributed.mesh import PP, ParallelDims, divisors, either
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


class Pipeline(Dimension):
    name = "pipeline parallel"
    keys = ("pipeline_parallel", "pipeline_schedule", "pipeline_microbatches", "pipeline_stages_per_rank",
            "pipeline_split")
    names_layout = True  # the strategy's name alone does not say that a rank holds some stages only

    def on(self, dims: ParallelDims) -> bool:
        return dims.pipeline > 1

    def check(self, config: Config) -> None:
        if config.dist.pipeline_parallel > 1:
            check_keys(config.dist)

    def share(self, config: DistConfig, world_size: int, rest: int, local_world_size: int) -> int:
        pp = config.pipeline_parallel
        if rest % pp:
            raise ConfigError(f"dist.pipeline_parallel = {pp}: does not divide world size {world_size}; use "
                              f"{either(divisors(world_size))} (the divisors of {world_size}), or a world size that "
                              f"is a multiple of {pp}")
        return pp

    def shards_state(self, config: DistConfig) -> bool:
        return config.pipeline_parallel > 1  # each stage is an FSDP2 module: ddp's are replicated, not sharded

    def sizes(self, config: DistConfig) -> dict[str, int]:
        return {"pipeline": config.pipeline_parallel}

    def mesh_dims(self, dims: ParallelDims, mesh: Mesh) -> Mesh:
        return (((PP, dims.pipeline),) if self.on(dims) else ()) + mesh  # outermost

    def words(self, dims: ParallelDims, words: Words) -> Words:
        return (((PP, f"{PP} {dims.pipeline}"),) if self.on(dims) else ()) + words

    def passes(self, dims: ParallelDims, config: DistConfig) -> int:
        return microbatches(config) if self.on(dims) else 1  # FSDP2 gathers a stage's blocks for each microbatch
