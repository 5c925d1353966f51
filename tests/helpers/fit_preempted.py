"""A fit() script for the preemption tests: with DISTRIB_TEST_DIE_AT=N, DISTRIB_TEST_DIE_SIGNAL=SIGTERM, the worker
of RANK DISTRIB_TEST_DIE_RANK sends itself SIGTERM in step N (tests.helpers.dying_model), an exact step on any machine.

    python tests/helpers/fit_preempted.py RUN_DIR [RUN_DIR ...]
    distrib launch --nproc-per-node 2 tests/helpers/fit_preempted.py RUN_DIR [RUN_DIR ...]

One fit() per RUN_DIR, in order, in the same processes (a preempted one ends the script with 75)."""

import sys

import torch

from distrib import fit
from tests.helpers.dying_model import network

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(320, 1, 28, 28, generator=g), torch.randint(0, 10, (320,), generator=g)
    for run_dir in sys.argv[1:]:
        fit(network, (inputs[:256], labels[:256]), (inputs[256:], labels[256:]),
            overrides={"train.max_steps": 16, "train.global_batch_size": 32, "train.warmup_steps": 2,
                       "checkpoint.every_steps": 4, "run.progress": False, "dist.device": "cpu", "run.dir": run_dir})
