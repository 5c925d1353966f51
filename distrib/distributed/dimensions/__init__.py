"""The parallel degrees, each declared once in its own module (a Dimension: base.py), and what iterates over them:
the config's rules, the sizes that tile the world, the model checks before any worker, the mesh's dimensions and the
layout's words, parallelize's steps, the step's hooks, and the plan's traffic. A new degree is a module here and one
entry in DIMENSIONS (docs/layouts.md, Adding a dimension); no file outside names it.

Imports point downward: this package imports the mesh (distrib.distributed.mesh) and the mechanism modules
(tensor_parallel, expert_parallel, fsdp), never parallelize, the pipeline package or the strategies, which iterate
over it."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Callable, Iterator, Mapping

import torch.nn as nn

from distrib.config import Config, DistConfig
from distrib.distributed.across import StepAcross
from distrib.distributed.dimensions.base import (
    PREPARE,
    Dimension,
    Layout,
    Mesh,
    StepCost,
    Traffic,
    Training,
    Words,
    group_split,
)
from distrib.distributed.dimensions.context import ContextParallel
from distrib.distributed.dimensions.data import DataParallel
from distrib.distributed.dimensions.experts import ExpertParallel
from distrib.distributed.dimensions.pipeline import Pipeline
from distrib.distributed.dimensions.replica_groups import ReplicaGroups
from distrib.distributed.dimensions.tensor import TensorParallel
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import LaunchEnv

# The order the layout is checked and its mesh composed: the replica groups first (worlds of their own, outside any
# mesh), then the pipeline's stages outermost (they take the first share of the world), the data-parallel degrees,
# context parallel, tensor parallel innermost, and expert parallel last, since it splits the data degrees' `shard`
# rather than adding a dimension. parallelize's order is each one's step_at; the plan sums the traffic innermost first.
DIMENSIONS: tuple[Dimension, ...] = (ReplicaGroups(), Pipeline(), DataParallel(), ContextParallel(), TensorParallel(),
                                     ExpertParallel())


def check(config: Config) -> None:
    """Each degree's one-line refusals, in the declared order (before any worker starts)."""
    for dimension in DIMENSIONS:
        dimension.check(config)


def shares(config: DistConfig, world_size: int, local_world_size: int) -> list[tuple[Dimension, int]]:
    """Each degree's share of the world (1: none), in the declared order, before the data-parallel ranks are
    counted, or a one-line ConfigError naming the degree that does not divide what the ones before left."""
    taken, rest = [], world_size
    for dimension in DIMENSIONS:
        taken.append((dimension, dimension.share(config, world_size, rest, local_world_size)))
        rest //= taken[-1][1]
    return taken


def data_parallel_size(config: DistConfig, world_size: int, local_world_size: int) -> int:
    """The ranks that read different micro-batches once the degrees that take a share of the world (pipeline,
    tensor parallel) have taken theirs, or a one-line ConfigError naming the degree that does not divide it."""
    return world_size // math.prod(share for _, share in shares(config, world_size, local_world_size))


def worlds(config: DistConfig, world_size: int, local_world_size: int) -> int:
    """Into how many worlds of their own (each its own mesh) a job of world_size ranks splits (the plan's question;
    a worker's world is one of them already), or a one-line ConfigError naming the degree they do not tile."""
    count = 1
    for dimension in DIMENSIONS:
        count *= dimension.worlds(config, world_size, local_world_size)
    return count


def shards_state(config: DistConfig) -> bool:
    """Whether a degree of this config needs the state in shards whatever dist.strategy names (a pipeline)."""
    return any(dimension.shards_state(config) for dimension in DIMENSIONS)


def sizes(config: DistConfig) -> dict[str, int]:
    """The degrees' fields of ParallelDims (the data-parallel ones, replicas and shards, are the strategy's)."""
    return {field: size for dimension in DIMENSIONS for field, size in dimension.sizes(config).items()}


def check_sizes(dims: ParallelDims, config: DistConfig) -> None:
    for dimension in DIMENSIONS:
        dimension.check_sizes(dims, config)


def model_checks(dims: ParallelDims) -> list[Dimension]:
    """The degrees of this run that check the model before any worker starts (each builds nothing: one model on meta
    serves them all)."""
    return [dimension for dimension in DIMENSIONS if dimension.on(dims) and dimension.checks_model]


def check_model(model: nn.Module, dims: ParallelDims, world_size: int) -> None:
    for dimension in model_checks(dims):
        dimension.check_model(model, dims, world_size)


def mesh_dims(dims: ParallelDims) -> Mesh:
    """(name, size) of the one mesh, outermost first: what ParallelDims.dims() records."""
    mesh: Mesh = ()
    for dimension in DIMENSIONS:
        mesh = dimension.mesh_dims(dims, mesh)
    return mesh


def describe(dims: ParallelDims) -> str:
    """'pp 2 x shard 4 (ep 2) x tp 2': the layout in words (what ParallelDims.describe() says)."""
    words: Words = ()
    for dimension in DIMENSIONS:
        words = dimension.words(dims, words)
    return " x ".join(said for _, said in words)


def layout_words(dims: ParallelDims) -> str:
    """': pp 2 x shard 2 x tp 2' for the start-up memory line, when a degree on says that a rank holds part of each
    block or some stages only (the strategy's name says the rest); '' otherwise."""
    return f": {describe(dims)}" if any(d.names_layout and d.on(dims) for d in DIMENSIONS) else ""


def parallelize_steps(dims: ParallelDims, prepare) -> list:
    """The steps of parallelize, in their order: each degree's on this run at its step_at, and `prepare` (what
    changes the module itself) at PREPARE. Each step takes (model, Layout) and returns the model."""
    steps = [(d.step_at, d.parallelize) for d in DIMENSIONS if d.step_at is not None and d.on(dims)]
    return [step for _, step in sorted([*steps, (PREPARE, prepare)], key=lambda at_step: at_step[0])]


def transform_batch(batch, dims: ParallelDims, rank: int):
    """A micro-batch as each degree cuts it for this rank (context parallel: its cut of every window)."""
    for dimension in DIMENSIONS:
        batch = dimension.transform_batch(batch, dims, rank)
    return batch


def counted(inputs, dims: ParallelDims) -> tuple[object, Callable[[], int]]:
    """The plan's forward of this rank's cut inputs with each degree's count of what it sends (Dimension.counted),
    and the sum of the counts once it ran."""
    counts = []
    for dimension in DIMENSIONS:
        inputs, count = dimension.counted(inputs, dims)
        counts.append(count)
    return inputs, lambda: sum(count() for count in counts)


def loss_count(count: int, dims: ParallelDims) -> int:
    """How many shares a step's loss is normalised into, from `count` ranks' (Dimension.loss_count)."""
    for dimension in DIMENSIONS:
        count = dimension.loss_count(count, dims)
    return count


def _passes(dims: ParallelDims, config: DistConfig, step: StepCost) -> StepCost:
    """step.passes (the micro-steps) times what each degree multiplies them by (a pipeline's microbatches)."""
    for dimension in DIMENSIONS:
        step = replace(step, passes=step.passes * dimension.passes(dims, config))
    return step


def traffic_lines(dims: ParallelDims, config: DistConfig, step: StepCost) -> list[tuple[str, float, float]]:
    """(name, intra-node, inter-node bytes) of the degrees' traffic that the plan names on a line of its own (also in
    step_traffic's total)."""
    lines, step = [], _passes(dims, config, step)
    for dimension in DIMENSIONS:
        parts = dimension.traffic(dims, config, step) if dimension.traffic_name else []
        if parts:
            lines.append((dimension.traffic_name, sum(p.intra for p in parts), sum(p.inter for p in parts)))
    return lines


def step_traffic(dims: ParallelDims, config: DistConfig, step: StepCost) -> tuple[float, float]:
    """(intra-node, inter-node) bytes each rank sends per optimizer step over the mesh, each degree's parts summed
    innermost first. step.passes: the micro-steps, times what each degree multiplies them by (a pipeline)."""
    parts = traffic_parts(dims, config, step)
    return sum(p.intra for p in parts), sum(p.inter for p in parts)


def traffic_parts(dims: ParallelDims, config: DistConfig, step: StepCost) -> list[Traffic]:
    """What each rank sends per optimizer step over the mesh, by mesh dimension and collective, innermost first."""
    step = _passes(dims, config, step)
    return [part for dimension in reversed(DIMENSIONS) for part in dimension.traffic(dims, config, step)]


def launch_flags(config: Config, environ: Mapping[str, str]) -> list[str]:
    """distrib launch's flags that `distrib train` adds for the degrees of this config (a worker's: none)."""
    return [flag for dimension in DIMENSIONS for flag in dimension.launch_flags(config, environ)]


def worker_config(config: Config, env: LaunchEnv) -> Config:
    """The config this worker runs, as each degree makes it from its launch environment."""
    for dimension in DIMENSIONS:
        config = dimension.worker_config(config, env)
    return config


@contextlib.contextmanager
def around_training(training: Training) -> Iterator[StepAcross | None]:
    """What the degrees hold around the worker's training steps; yields what each step agrees on with other worlds
    (at most one degree's: the replica groups'), or None."""
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(dimension.around_training(training)) for dimension in DIMENSIONS]
        yield next((across for across in held if across is not None), None)


__all__ = ["DIMENSIONS", "Dimension", "Layout", "StepCost", "Training", "around_training", "check", "check_model",
           "check_sizes", "counted", "data_parallel_size", "describe", "group_split", "launch_flags", "layout_words",
           "loss_count", "mesh_dims", "model_checks", "parallelize_steps", "shards", "shards_state", "sizes",
           "step_traffic", "Traffic", "traffic_lines", "traffic_parts", "transform_batch", "worker_config", "worlds"]
