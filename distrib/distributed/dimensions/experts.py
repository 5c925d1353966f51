"""Expert parallel's declaration (dist.expert_parallel): its rules, the split of the data degree's `shard` dimension
into (shard_mod_ep, ep) (its ranks are data ranks, each reading its own batch: the world and the batch streams stay
as they are), its words, its step in parallelize (after tensor parallel, before FSDP, so that FSDP shards each rank's
own experts) and the model check before any worker. The mechanism (the experts split and routed by all-to-all) is
distrib.distributed.expert_parallel; the plan's count of its all-to-alls is distrib.plan.experts."""

from __future__ import annotations

import torch.nn as nn

from distrib.config import Config, DistConfig
from distrib.distributed.dimensions.base import SPLIT_EXPERTS, Dimension, Layout, Mesh, Words
from distrib.distributed.expert_parallel import apply_expert_parallel, check_model
from distrib.distributed.mesh import EP, SHARD, SHARD_MOD_EP, ParallelDims, divisors, either
from distrib.errors import ConfigError


class ExpertParallel(Dimension):
    name = "expert parallel"
    keys = ("expert_parallel",)
    step_at = SPLIT_EXPERTS
    checks_model = True

    def on(self, dims: ParallelDims) -> bool:
        return dims.expert_parallel > 1

    def check(self, config: Config) -> None:
        dist = config.dist
        if dist.expert_parallel > 1 and dist.strategy == "ddp":
            raise ConfigError(f"dist.expert_parallel = {dist.expert_parallel}: splits the experts over the ranks of "
                              "a shard group, and dist.strategy is ddp (a whole replica on every rank); set --set "
                              "dist.strategy=fsdp (or hsdp), or --set dist.expert_parallel=1")

    def sizes(self, config: DistConfig) -> dict[str, int]:
        return {"expert_parallel": config.expert_parallel}

    def check_sizes(self, dims: ParallelDims, config: DistConfig) -> None:
        """E must divide the shard group whose ranks split the experts (fsdp: every data-parallel rank; hsdp:
        dist.shard_size's)."""
        experts, shard = config.expert_parallel, dims.shard
        if shard % experts:
            group = "hsdp's shard groups (dist.shard_size)" if config.strategy == "hsdp" else \
                "the fsdp ranks (world size / dist.pipeline_parallel / dist.tensor_parallel)"
            raise ConfigError(f"dist.expert_parallel = {experts}: does not divide the {shard} ranks of {group}, "
                              f"among which the experts are split; use {either(divisors(shard))}, or more ranks per "
                              "shard group")

    def check_model(self, model: nn.Module, dims: ParallelDims, world_size: int) -> None:
        check_model(model, dims.expert_parallel)  # its experts, each MoE layer's a count E divides

    def mesh_dims(self, dims: ParallelDims, mesh: Mesh) -> Mesh:
        if not (self.on(dims) and dims.fully_shard):
            return mesh
        split = ((SHARD_MOD_EP, dims.shard // dims.expert_parallel), (EP, dims.expert_parallel))
        return tuple(part for name, size in mesh for part in (split if name == SHARD else ((name, size),)))

    def words(self, dims: ParallelDims, words: Words) -> Words:
        if not self.on(dims):
            return words  # the split named within its shard group
        return tuple((name, f"{said} ({EP} {dims.expert_parallel})" if name == SHARD else said)
                     for name, said in words)

    def parallelize(self, model: nn.Module, layout: Layout) -> nn.Module:
        dims = layout.dims
        ep, rest = dims.expert_meshes()
        # each MoE layer's experts split over `ep`; FSDP2 units of their own over the rest of the data-parallel ranks
        # (and those that share their tokens), their gradients divided by every rank whose backward added to them, as
        # the dense ones'
        layout.experts = (apply_expert_parallel(model, ep), rest, dims.data_parallel * dims.token_split)
        return model
