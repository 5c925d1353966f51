"""The layout checked before any worker starts (distrib train's launcher): every parallel degree against the world
size, under tensor parallel the model's plan and attention heads, and under expert parallel its experts, on the model
built on the meta device."""

from __future__ import annotations

from distrib.config import Config
from distrib.distributed.expert_parallel import check_model
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.strategies import parallel_dims
from distrib.distributed.strategies.materialise import build_on_meta
from distrib.distributed.tensor_parallel import tensor_parallel_plan
from distrib.models.build import build_without_data


def check_layout(config: Config, world_size: int, local_world_size: int) -> ParallelDims:
    """The launcher's check of the layout, before any worker starts: every degree against this world size
    (parallel_dims), under dist.tensor_parallel the model's plan and attention heads, and under dist.expert_parallel
    its experts (each MoE layer's, a count the degree divides), on the model built on the meta device where it needs
    no data (build_without_data; otherwise each worker checks them once it has built it). A one-line ConfigError
    naming the key, the value and the fix."""
    dims = parallel_dims(config.dist, world_size, local_world_size)
    if dims.tensor_parallel > 1 or dims.expert_parallel > 1:
        model = build_on_meta(lambda: build_without_data(config.model), config.train.seed)
        if model is not None and dims.tensor_parallel > 1:
            tensor_parallel_plan(model, dims.tensor_parallel, world_size // dims.pipeline)
        if model is not None and dims.expert_parallel > 1:
            check_model(model, dims.expert_parallel)
    return dims
