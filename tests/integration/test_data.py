"""Data: real IDX files through torchvision's loader, offline sources, the batch plan, and the two loader paths."""


import pytest
import torch

from distrib.data import Augment, BatchPlan, DeviceBatches, LoaderBatches, Normalizer, Split, epoch_steps
from distrib.distributed.runtime import Runtime

CPU = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


@pytest.mark.parametrize("shape, augment", [((1, 28, 28), None), ((3, 12, 10), "crop_flip")])
def test_the_two_loader_paths_give_identical_batches(shape, augment):
    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (300, *shape), generator=g, dtype=torch.uint8),
                  torch.randint(0, 10, (300,), generator=g))
    plan = BatchPlan(len(split), 40, 2, 1, 2, seed=5)
    normalizer = Normalizer((0.3,) * shape[0], tuple(0.2 + 0.1 * c for c in range(shape[0])), uint8=True)
    aug = Augment(augment, seed=2) if augment else None
    for workers in (0, 2):
        loader = LoaderBatches(split, CPU, workers, normalizer, aug)
        for epoch, start in ((0, 0), (1, 3)):
            a = list(epoch_steps(DeviceBatches(split, CPU, normalizer, aug), plan, epoch, start))
            b = list(epoch_steps(loader, plan, epoch, start))
            assert len(a) == len(b) == plan.steps_per_epoch - start
            for step_a, step_b in zip(a, b):
                assert len(step_a) == len(step_b) == 2
                for (xa, ya), (xb, yb) in zip(step_a, step_b):
                    assert xa.shape == (10, *shape) and xa.dtype == torch.float32
                    assert torch.equal(xa, xb) and torch.equal(ya, yb)
