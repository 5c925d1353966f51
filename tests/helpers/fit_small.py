"""A small distrib.fit script, the same under torchrun and inside a Ray TorchTrainer's train_loop_per_worker:

    torchrun --standalone --nproc-per-node 2 tests/helpers/fit_small.py RUN_DIR
    TorchTrainer(lambda _: fit_small.main(RUN_DIR), ...)

Its model dies at an exact step as tests.helpers.dying_model's do (DISTRIB_TEST_DIE_AT, DISTRIB_TEST_DIE_ONCE);
checkpoints every 2 of its 4 steps."""

import sys

import torch

from distrib import fit
from tests.helpers.dying_model import _build, _DiesAt


class _Linear(torch.nn.Sequential):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(in_features, num_classes))


class _DyingLinear(_DiesAt, _Linear):
    pass


def model(num_classes, in_channels, image_size):
    return _build(_Linear, _DyingLinear, in_features=in_channels * image_size ** 2, num_classes=num_classes)


def main(run_dir: str) -> dict:
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(192, 1, 8, 8, generator=g), torch.randint(0, 4, (192,), generator=g)
    return fit(model, (inputs[:128], labels[:128]), (inputs[128:], labels[128:]),
               overrides={"train.max_steps": 4, "train.global_batch_size": 32, "train.warmup_steps": 1,
                          "checkpoint.every_steps": 2, "run.progress": False, "dist.device": "cpu",
                          "run.dir": run_dir})


if __name__ == "__main__":
    main(sys.argv[1])
