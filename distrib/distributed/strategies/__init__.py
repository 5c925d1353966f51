"""The strategies, one object each: how the model is built, placed, wrapped and synced, how its state is gathered,
loaded and saved, and what distrib plan reports (base: the contract and the registry of names; ddp; fsdp; hsdp;
pipeline). Each class registers the dist.strategy names it serves and checks the config's rules about itself."""

from __future__ import annotations

from distrib.config import Config, DistConfig
from distrib.distributed.mesh import ParallelDims, data_parallel_size
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies.base import Build, LoadWeights, StepLoss, Strategy, registered, strategy_named
from distrib.distributed.strategies.ddp import DDPStrategy
from distrib.distributed.strategies.fsdp import FSDPStrategy
from distrib.distributed.strategies.hsdp import HSDPStrategy
from distrib.distributed.strategies.pipeline import PipelineStrategy


def strategy_class(config: DistConfig) -> type[Strategy]:
    """The class that runs this config: pipeline parallel where dist.pipeline_parallel > 1 (composed with the
    data-parallel strategy dist.strategy names), else the class that registered dist.strategy."""
    return PipelineStrategy if config.pipeline_parallel > 1 else strategy_named(config.strategy)


def check_config(config: Config) -> None:
    """The rules of the config's strategy (the keys it takes, the precision and checkpoints its state allows): a
    one-line ConfigError, before any worker starts (distrib train and plan, distrib.fit, the worker)."""
    strategy_class(config.dist).check(config)


def parallel_dims(config: DistConfig, world_size: int, local_world_size: int) -> ParallelDims:
    """The degrees dist.strategy, dist.pipeline_parallel, dist.shard_size and dist.tensor_parallel ask for at this
    world size, or a one-line ConfigError naming the value that does not tile the world and the fix."""
    data_parallel = data_parallel_size(config, world_size, local_world_size)
    replicate, shard = strategy_class(config).replicas_and_shards(config, data_parallel, world_size, local_world_size)
    return ParallelDims(config.strategy, replicate, shard, config.tensor_parallel, config.pipeline_parallel)


def make_strategy(config: DistConfig, world_size: int, local_world_size: int) -> Strategy:
    """The strategy that runs this config (strategy_class), over the mesh it asks for at this world size (a
    one-line ConfigError if the sizes do not tile the world)."""
    return strategy_class(config)(config, parallel_dims(config, world_size, local_world_size))


def for_trained(config: DistConfig, runtime: Runtime) -> Strategy:
    """The strategy distrib eval and predict run a trained model under, whatever strategy trained it: its weights are
    whole (model.pt, weights/) and each rank runs its own batches, so ddp's whole replica on every rank of this world
    (no mesh: a run trained with pipeline or tensor parallel is evaluated at any world size)."""
    return DDPStrategy(config, ParallelDims("ddp", runtime.world_size, 1))


__all__ = ["Build", "DDPStrategy", "FSDPStrategy", "HSDPStrategy", "LoadWeights", "PipelineStrategy", "StepLoss",
           "Strategy", "check_config", "for_trained", "make_strategy", "parallel_dims", "registered",
           "strategy_class", "strategy_named"]
