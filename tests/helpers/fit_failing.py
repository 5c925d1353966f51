"""A fit() script whose model raises on rank 1 only (in the dry batch fit runs first), or with `config` whose
overrides hold a mistyped key (every rank finds it), for the launcher tests.

    distrib launch --nproc-per-node 2 tests/helpers/fit_failing.py RUN_DIR [config]"""

import os
import sys

import torch

from distrib import fit


class RaisesOnRank1(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 3)

    def forward(self, inputs):
        if os.environ.get("RANK") == "1":
            raise ValueError("my model cannot take this batch on rank 1")
        return self.linear(inputs.flatten(1))


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(128, 1, 4, 4, generator=g), torch.randint(0, 3, (128,), generator=g)
    mistake = {"train.lrr": 0.1} if sys.argv[2:] == ["config"] else {}
    fit(RaisesOnRank1(), (inputs, labels), (inputs, labels),
        overrides={"train.max_steps": 2, "train.global_batch_size": 32, "train.warmup_steps": 1,
                   "run.progress": False, "dist.device": "cpu", "run.dir": sys.argv[1], **mistake})
