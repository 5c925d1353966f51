"""The layout checked before any worker starts (distrib train's launcher): every parallel degree against the world
size, and the model of the degrees that lay it out by its own declarations (under tensor parallel its plan and
attention heads, under expert parallel its experts), on the model built on the meta device."""

from __future__ import annotations

from distrib.config import Config
from distrib.distributed import dimensions
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.strategies import parallel_dims
from distrib.distributed.strategies.materialise import build_on_meta
from distrib.models.build import build_without_data


def check_layout(config: Config, world_size: int, local_world_size: int) -> ParallelDims:
    """The launcher's check of the layout, before any worker starts: every degree against this world size
    (parallel_dims), then each degree of this run that checks the model (dimensions.check_model), on the model built
    on the meta device once, where it needs no data (build_without_data; otherwise each worker checks it once it has
    built it). A one-line ConfigError naming the key, the value and the fix."""
    dims = parallel_dims(config.dist, world_size, local_world_size)
    if dimensions.model_checks(dims):
        model = build_on_meta(lambda: build_without_data(config.model), config.train.seed)
        if model is not None:
            dimensions.check_model(model, dims, world_size)
    return dims
