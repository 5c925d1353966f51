"""Alone or under torchrun: evaluates one seeded, untrained Network on a 1003-sample test set and writes the metrics.

argv: OUT_JSON LOADERS (device, dataloader, or both comma-separated: one launch, one metrics dict per loader)."""

import json
import sys

import torch

from distrib.cli import hard_exit
from distrib.config import load_config
from distrib.data import load_data
from distrib.distributed.parallel import place_model
from distrib.distributed.parallelize import wrap_ddp
from distrib.distributed.runtime import open_runtime
from distrib.models.network import Network
from distrib.training.evaluation import evaluate


def main(out: str, loaders: str) -> None:
    configs = [load_config(None, ["data.name=synthetic", "data.synthetic_test_size=1003", "data.eval_batch_size=100",
                                  f"data.loader={loader}", "dist.device=cpu"]) for loader in loaders.split(",")]
    results = []
    with open_runtime(configs[0].dist) as runtime:
        for config in configs:
            data = load_data(config.data, runtime, config.train.seed)
            torch.manual_seed(0)
            model = wrap_ddp(place_model(Network(), runtime.device), runtime)
            metrics = evaluate(model, data.test, data.info.num_classes, config.data.eval_batch_size, runtime)
            results.append({**metrics, "world_size": runtime.world_size})
        if runtime.is_main:
            with open(out, "w") as f:
                json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    hard_exit(0)
