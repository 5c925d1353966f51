"""Builds a config's model as its strategy does (distrib.distributed.strategies), under torchrun, and writes what
rank 0 gathers of the starting weights (OUT/weights.pt) and each rank's peak resident memory (OUT/rss_RANK.json),
without training: for the tests that sharded runs start from one process's weights and hold no whole model.

argv: OUT --set section.key=value ..."""

import json
import resource
import sys
from pathlib import Path

import torch

from distrib.config import load_config
from distrib.data import load_data
from distrib.distributed.runtime import open_runtime
from distrib.distributed.strategies import Build, make_strategy
from distrib.models.build import build_model

if __name__ == "__main__":
    out, overrides = Path(sys.argv[1]), sys.argv[3::2]
    config = load_config(None, overrides)
    with open_runtime(config.dist) as runtime:
        strategy = make_strategy(config.dist, runtime.world_size, runtime.local_world_size)
        runtime = runtime.with_mesh(strategy.dims)
        data = load_data(config.data, runtime, config.train.seed, log=lambda message: None)
        lines = []
        model = strategy.setup_module(Build(lambda: build_model(config.model, data.info), config.train.seed,
                                            log=lines.append), runtime)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        weights = strategy.full_model_state(model)
        if runtime.is_main:
            torch.save(weights, out / "weights.pt")
        (out / f"rss_{runtime.rank}.json").write_text(json.dumps({"peak_rss_bytes": peak, "log": lines}))
