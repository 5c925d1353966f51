"""Run under torchrun: evaluates one seeded, untrained Network on a 1003-sample test set and writes the metrics.

argv: OUT_JSON LOADER (device | dataloader)."""

import json
import sys

import torch

from distrib.cli import hard_exit
from distrib.config import load_config
from distrib.data import load_splits, make_batches
from distrib.models import Network
from distrib.parallel import place_model, wrap_ddp
from distrib.runtime import open_runtime
from distrib.train import evaluate


def main(out: str, loader: str) -> None:
    config = load_config(None, ["data.name=synthetic", "data.synthetic_test_size=1003", "data.eval_batch_size=100",
                                f"data.loader={loader}", "dist.device=cpu"])
    with open_runtime(config.dist) as runtime:
        _, test = load_splits(config.data, runtime)
        torch.manual_seed(0)
        model = wrap_ddp(place_model(Network(), runtime.device), runtime)
        source = make_batches(test, config.data, runtime, test.nbytes())
        metrics = evaluate(model, source, len(test), config.data.eval_batch_size, runtime)
        if runtime.is_main:
            with open(out, "w") as f:
                json.dump({**metrics, "world_size": runtime.world_size}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    hard_exit(0)
