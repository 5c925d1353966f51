"""Tensor parallel's declaration (dist.tensor_parallel): its rules, its share of the world, its `tp` mesh dimension
(innermost: all-reduces of the residual stream in every block, the most traffic, kept within a node), its words, its
step in parallelize (the first, so that FSDP shards the tensor-parallel slices), the model check before any worker,
and its traffic. The mechanism (the model's plan, parallelize_module) is distrib.distributed.tensor_parallel."""

from __future__ import annotations

import torch.nn as nn

from distrib.config import Config, DistConfig
from distrib.distributed.dimensions.base import (
    SPLIT_TENSORS,
    Dimension,
    Layout,
    Mesh,
    StepCost,
    Traffic,
    Words,
    group_split,
)
from distrib.distributed.mesh import TP, ParallelDims
from distrib.distributed.tensor_parallel import apply_tensor_parallel, tensor_parallel_plan
from distrib.errors import ConfigError


class TensorParallel(Dimension):
    name = "tensor parallel"
    keys = ("tensor_parallel",)
    step_at = SPLIT_TENSORS
    checks_model = True
    names_layout = True  # the strategy's name alone does not say that a rank holds slices of every block

    def on(self, dims: ParallelDims) -> bool:
        return dims.tensor_parallel > 1

    def check(self, config: Config) -> None:
        dist = config.dist
        if dist.tensor_parallel > 1 and dist.strategy == "ddp":
            raise ConfigError(f"dist.tensor_parallel = {dist.tensor_parallel}: composes with fsdp or hsdp on the "
                              "data-parallel ranks, and dist.strategy is ddp; set --set dist.strategy=fsdp (or hsdp)")

    def share(self, config: DistConfig, world_size: int, rest: int, local_world_size: int) -> int:
        pp, tp = config.pipeline_parallel, config.tensor_parallel
        if rest % tp:
            raise ConfigError(f"dist.tensor_parallel = {tp}: does not divide world size {world_size}"
                              + (f" / pipeline parallel {pp}" if pp > 1 else "")
                              + f"; use a divisor of {rest} (ideally of the {local_world_size} ranks per "
                              f"node), or a world size that is a multiple of {world_size // rest * tp}")
        return tp

    def sizes(self, config: DistConfig) -> dict[str, int]:
        return {"tensor_parallel": config.tensor_parallel}

    def check_model(self, model: nn.Module, dims: ParallelDims, world_size: int) -> None:
        tensor_parallel_plan(model, dims.tensor_parallel, world_size // dims.pipeline)  # its plan, its heads

    def mesh_dims(self, dims: ParallelDims, mesh: Mesh) -> Mesh:
        return mesh + (((TP, dims.tensor_parallel),) if self.on(dims) else ())  # innermost

    def words(self, dims: ParallelDims, words: Words) -> Words:
        return words + (((TP, f"{TP} {dims.tensor_parallel}"),) if self.on(dims) else ())

    def parallelize(self, model: nn.Module, layout: Layout) -> nn.Module:
        apply_tensor_parallel(model, layout.dims.mesh[TP], stage=layout.roots is not None)
        return model

    def traffic(self, dims: ParallelDims, config, step: StepCost) -> list[Traffic]:
        """The residual stream's all-reduces within its group, every pass."""
        if not self.on(dims):
            return []
        split = group_split(dims.tensor_parallel, 1, step.per_node, step.activation_bytes * step.passes, 2)
        return [Traffic(TP, "all-reduce", *split)]
