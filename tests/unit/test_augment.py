"""Augmentation on the device, keyed by (seed, epoch, sample index): torchvision's per-sample ops as the reference,
the same batches at world sizes 1, 2 and 3 and after a resume, and bitwise-equal DataLoader and device paths."""

import pytest
import torch
from torchvision.transforms import functional as F

from distrib.data import Augment, BatchPlan, DeviceBatches, Split, epoch_steps
from distrib.data.augment import draws
from distrib.distributed.runtime import Runtime


def _runtime(rank: int = 0, world_size: int = 1) -> Runtime:
    return Runtime(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")


def _images(n=96, shape=(3, 10, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("mode", ["flip", "crop_flip"])
def test_batched_augmentation_equals_torchvision_per_sample(mode):
    images, indices, seed, epoch = _images(), torch.randperm(96)[:40], 5, 3
    got = Augment(mode, seed, padding=2)(images[indices], indices, epoch)
    flips = draws(indices, seed, epoch, 0) & 1
    dy, dx = draws(indices, seed, epoch, 1) % 5, draws(indices, seed, epoch, 2) % 5
    for i, index in enumerate(indices.tolist()):
        want = images[index]
        if mode == "crop_flip":
            want = F.crop(F.pad(want, [2]), int(dy[i]), int(dx[i]), 10, 12)  # RandomCrop(padding=2)'s arithmetic
        want = F.hflip(want) if flips[i] else want
        assert torch.equal(got[i], want), index
    assert 0.3 < flips.float().mean() < 0.7
    if mode == "crop_flip":
        assert set(dy.tolist()) == set(range(5)) == set(dx.tolist())


def test_draws_depend_on_seed_epoch_and_index_only():
    idx = torch.arange(1000)
    assert torch.equal(draws(idx, 1, 2, 0)[500:], draws(idx[500:], 1, 2, 0))  # not on the batch it sits in
    assert not torch.equal(draws(idx, 1, 2, 0), draws(idx, 1, 3, 0))
    assert not torch.equal(draws(idx, 1, 2, 0), draws(idx, 2, 2, 0))
    assert not torch.equal(draws(idx, 1, 2, 1), draws(idx, 1, 2, 2))


def _steps(split, rank, world_size, accum, epoch, start=0):
    source = DeviceBatches(split, _runtime(rank, world_size), augment=Augment("crop_flip", seed=11))
    plan = BatchPlan(len(split), 24, accum, rank, world_size, seed=4)
    return [[x for x, _ in step] for step in epoch_steps(source, plan, epoch, start)]


def test_crop_flip_batches_are_the_same_at_any_world_size_and_after_a_resume():
    split = Split(_images(), torch.zeros(96, dtype=torch.long))
    for epoch in (0, 1):
        single = [torch.cat(step) for step in _steps(split, 0, 1, 1, epoch)]
        for world_size, accum in ((2, 1), (3, 2)):
            ranks = [_steps(split, rank, world_size, accum, epoch) for rank in range(world_size)]
            for step, want in enumerate(single):  # the union of the ranks' slices, in rank order
                assert torch.equal(torch.cat([x for rank in ranks for x in rank[step]]), want)
        resumed = _steps(split, 0, 1, 1, epoch, start=2)
        assert all(torch.equal(torch.cat(a), b) for a, b in zip(resumed, single[2:], strict=True))
    assert not torch.equal(torch.cat(_steps(split, 0, 1, 1, 0)[0]), torch.cat(_steps(split, 0, 1, 1, 1)[0]))


def test_bench_augment_runs_and_prints_its_table(capsys):
    """The bench's numbers are for scripts, not tests; here only that it runs and reports both kinds of rows."""
    import importlib.util

    from tests.helpers.support import REPO

    spec = importlib.util.spec_from_file_location("bench_augment", REPO / "scripts" / "bench_augment.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        bench.main(["--samples", "256", "--batch", "64", "--repeats", "1", "--workers", "0"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "distrib crop_flip (device-resident, batched)" in out and "torchvision per-sample, 0 workers" in out
    assert "distrib / best torchvision row:" in out
