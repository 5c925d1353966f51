"""The strategies, one object each: how the model is built, placed, wrapped and synced, how its state is gathered,
loaded and saved, and what distrib plan reports (base: the contract; ddp; fsdp: fsdp, hsdp and tensor parallel)."""

from __future__ import annotations

from distrib.config import DistConfig
from distrib.distributed.mesh import mesh_shape
from distrib.distributed.strategies.base import Build, LoadWeights, Strategy
from distrib.distributed.strategies.ddp import DDPStrategy
from distrib.distributed.strategies.fsdp import FSDPStrategy

# dist.strategy -> its class; hsdp is fsdp on a 2-D mesh (the MeshShape says which).
STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "hsdp": FSDPStrategy}


def make_strategy(config: DistConfig, world_size: int, local_world_size: int) -> Strategy:
    """The strategy dist.strategy names, over the mesh it asks for at this world size (a one-line ConfigError if the
    sizes do not tile the world)."""
    return STRATEGIES[config.strategy](config, mesh_shape(config, world_size, local_world_size))


__all__ = ["STRATEGIES", "Build", "DDPStrategy", "FSDPStrategy", "LoadWeights", "Strategy", "make_strategy"]
