"""The strategies, one object each: how a layout's state is held (whole: ddp; sharded: fsdp, hsdp and every
pipeline), built, synced, gathered, loaded and saved (base: the contract and the registry of names; ddp; fsdp). Each
class registers the dist.strategy names it serves and checks the config's rules about itself; the degrees are the
mesh's (distrib.distributed.mesh), applied by the one parallelize."""

from __future__ import annotations

from distrib.config import Config, DistConfig
from distrib.distributed import fault_tolerance, pipeline
from distrib.distributed.mesh import ParallelDims, check_expert_parallel, data_parallel_size
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies.base import Build, LoadWeights, StepLoss, Strategy, registered, strategy_named
from distrib.distributed.strategies.ddp import DDPStrategy
from distrib.distributed.strategies.fsdp import FSDPStrategy


def strategy_class(config: DistConfig) -> type[Strategy]:
    """The class that runs this config: the one dist.strategy names, but under pipeline parallel the sharded one
    whatever it names (each stage is an FSDP2 module: ddp's stages are replicated, not sharded)."""
    named = strategy_named(config.strategy)
    return FSDPStrategy if config.pipeline_parallel > 1 and not named.sharded_state else named


def check_config(config: Config) -> None:
    """The rules of the config's layout (the keys dist.strategy takes, a pipeline's, what the state allows): a
    one-line ConfigError, before any worker starts (distrib train and plan, distrib.fit, the worker)."""
    strategy_named(config.dist.strategy).check_keys(config.dist)
    if config.dist.pipeline_parallel > 1:
        pipeline.check_keys(config.dist)
    strategy_class(config.dist).check(config)
    if config.dist.fault_tolerant_groups > 1:
        fault_tolerance.check(config)


def parallel_dims(config: DistConfig, world_size: int, local_world_size: int) -> ParallelDims:
    """The degrees dist.strategy, dist.pipeline_parallel, dist.shard_size, dist.tensor_parallel and
    dist.expert_parallel ask for at this world size, or a one-line ConfigError naming the value that does not tile the
    world and the fix."""
    data_parallel = data_parallel_size(config, world_size, local_world_size)
    named = strategy_named(config.strategy)
    replicate, shard = named.replicas_and_shards(config, data_parallel, world_size, local_world_size)
    check_expert_parallel(config, shard)
    return ParallelDims(replicate, shard, config.tensor_parallel, config.pipeline_parallel,
                        fully_shard=strategy_class(config).sharded_state, expert_parallel=config.expert_parallel,
                        fault_tolerant_groups=config.fault_tolerant_groups)


def make_strategy(config: DistConfig, world_size: int, local_world_size: int) -> Strategy:
    """The strategy that runs this config (strategy_class), over the mesh it asks for at this world size (a
    one-line ConfigError if the sizes do not tile the world)."""
    return strategy_class(config)(config, parallel_dims(config, world_size, local_world_size))


def for_trained(config: DistConfig, runtime: Runtime) -> Strategy:
    """The strategy distrib eval and predict run a trained model under, whatever strategy trained it: its weights are
    whole (model.pt, weights/) and each rank runs its own batches, so ddp's whole replica on every rank of this world
    (no mesh: a run trained with pipeline or tensor parallel is evaluated at any world size)."""
    return DDPStrategy(config, ParallelDims.replicas(runtime.world_size))


__all__ = ["Build", "DDPStrategy", "FSDPStrategy", "LoadWeights", "StepLoss", "Strategy", "check_config", "for_trained",
           "make_strategy", "parallel_dims", "registered", "strategy_class", "strategy_named"]
