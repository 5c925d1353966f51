"""Saves a 32 MB sharded checkpoint asynchronously (checkpoint.async_save) over and over until killed, each step's
weights all equal to the step (for the test that a kill during an asynchronous write is never resumed from).

argv: DIR [MODE]: MODE is checkpoint.async_save's, thread (the default) or process."""

import sys

import torch
import torch.nn as nn

from distrib.checkpoint import Checkpoints, ShardedStorage
from distrib.config import DistConfig
from distrib.distributed.parallelize import parallelize
from distrib.distributed.runtime import open_runtime
from distrib.distributed.strategies import make_strategy

if __name__ == "__main__":
    with open_runtime(DistConfig(device="cpu")) as runtime:
        strategy = make_strategy(DistConfig(strategy="fsdp"), runtime.world_size, runtime.local_world_size)
        strategy.dims.build_mesh("cpu")
        model = parallelize(nn.Linear(2048, 2048), strategy.dims, strategy.config, runtime)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        progress = {"step": 0}
        mode = sys.argv[2] if len(sys.argv) > 2 else "thread"
        checkpointer = Checkpoints(ShardedStorage(runtime, async_save=mode), sys.argv[1], runtime,
                                   lambda: {**strategy.training_state(model, optimizer), "progress": dict(progress)},
                                   every_steps=1, keep_last=2)
        checkpointer.start()  # the checkpoint process (process), as training's start does
        while True:
            progress["step"] += 1
            with torch.no_grad():
                for param in model.parameters():
                    param.fill_(float(progress["step"]))
            checkpointer.save(progress["step"])
            print(progress["step"], flush=True)
