"""The strategies, one object each: how the model is built, placed, wrapped and synced, how its state is gathered,
loaded and saved, and what distrib plan reports (base: the contract; ddp; fsdp: fsdp, hsdp and tensor parallel)."""

from __future__ import annotations

from distrib.config import DistConfig
from distrib.distributed.mesh import parallel_dims
from distrib.distributed.strategies.base import Build, LoadWeights, StepLoss, Strategy
from distrib.distributed.strategies.ddp import DDPStrategy
from distrib.distributed.strategies.fsdp import FSDPStrategy
from distrib.distributed.strategies.pipeline import PipelineStrategy

# dist.strategy -> its class; hsdp is fsdp on a 2-D mesh (the ParallelDims says which).
STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "hsdp": FSDPStrategy}


def make_strategy(config: DistConfig, world_size: int, local_world_size: int) -> Strategy:
    """The strategy dist.strategy names (pipeline parallel, composed with it, where dist.pipeline_parallel > 1), over
    the mesh it asks for at this world size (a one-line ConfigError if the sizes do not tile the world)."""
    dims = parallel_dims(config, world_size, local_world_size)
    return (PipelineStrategy if dims.pipeline > 1 else STRATEGIES[config.strategy])(config, dims)


__all__ = ["STRATEGIES", "Build", "DDPStrategy", "FSDPStrategy", "LoadWeights", "PipelineStrategy", "StepLoss", "Strategy", "make_strategy"]
