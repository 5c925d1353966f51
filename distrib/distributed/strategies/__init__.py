"""The strategies, one object each: how a layout's state is held (whole: ddp; sharded: fsdp, hsdp and every
pipeline), built, synced, gathered, loaded and saved (base: the contract and the registry of names; ddp; fsdp). Each
class registers the dist.strategy names it serves and checks what its state allows; the degrees are declared in
distrib.distributed.dimensions, recorded by the mesh (distrib.distributed.mesh) and applied by the one parallelize."""

from __future__ import annotations

from distrib.config import Config, DistConfig
from distrib.distributed import dimensions
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies.base import Build, LoadWeights, StepLoss, Strategy, registered, strategy_named
from distrib.distributed.strategies.ddp import DDPStrategy
from distrib.distributed.strategies.fsdp import FSDPStrategy


def strategy_class(config: DistConfig) -> type[Strategy]:
    """The class that runs this config: the one dist.strategy names, but the sharded one whatever it names where a
    degree needs the state in shards (pipeline parallel: each stage is an FSDP2 module; ddp's are replicated)."""
    named = strategy_named(config.strategy)
    return FSDPStrategy if dimensions.shards_state(config) and not named.sharded_state else named


def check_config(config: Config) -> None:
    """The rules of the config's layout, each declared degree's (distrib.distributed.dimensions), then what the
    strategy's state allows: a one-line ConfigError, before any worker starts (distrib train and plan, distrib.fit,
    the worker)."""
    dimensions.check(config)
    strategy_class(config.dist).check(config)


def parallel_dims(config: DistConfig, world_size: int, local_world_size: int) -> ParallelDims:
    """The degrees the config asks for at this world size (each declared degree's share of the world, then the
    strategy's replicas and shards of the rest), or a one-line ConfigError naming the value that does not tile the
    world and the fix."""
    data_parallel = dimensions.data_parallel_size(config, world_size, local_world_size)
    named = strategy_named(config.strategy)
    replicate, shard = named.replicas_and_shards(config, data_parallel, world_size, local_world_size)
    dims = ParallelDims(replicate, shard, fully_shard=strategy_class(config).sharded_state, **dimensions.sizes(config))
    dimensions.check_sizes(dims, config)
    return dims


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
