"""The hsdp strategy: fsdp on a 2-D mesh, sharded within groups of dist.shard_size ranks (one node's, by default) and
replicated across the groups. It differs from fsdp only by that layout: FSDPStrategy owns the model's life."""

from __future__ import annotations

from distrib.config import DistConfig
from distrib.distributed.strategies.fsdp import FSDPStrategy
from distrib.errors import ConfigError


class HSDPStrategy(FSDPStrategy):
    names = ("hsdp",)
    reads_shard_size = True

    @classmethod
    def replicas_and_shards(cls, config: DistConfig, data_parallel: int, world_size: int,
                            local_world_size: int) -> tuple[int, int]:
        tp, pp = config.tensor_parallel, config.pipeline_parallel
        shard = config.shard_size or max(1, min(data_parallel, local_world_size // tp))
        if data_parallel % shard:
            key = "dist.shard_size" if config.shard_size else \
                "LOCAL_WORLD_SIZE / dist.tensor_parallel (dist.shard_size)"
            raise ConfigError(f"{key} = {shard}: does not divide the {data_parallel} data-parallel ranks (world size "
                              f"{world_size} / tensor parallel {tp}" + (f" / pipeline parallel {pp}" if pp > 1 else "")
                              + f"); set --set dist.shard_size to a divisor of {data_parallel}, e.g. the ranks of one "
                              "node")
        return data_parallel // shard, shard
