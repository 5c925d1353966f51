"""Augmentation on the device, keyed by (seed, epoch, sample index): torchvision's per-sample ops as the reference,
the same batches at world sizes 1, 2 and 3 and after a resume, and bitwise-equal DataLoader and device paths."""

import pytest
import torch
from support import make_image_folder
from torchvision.transforms import functional as F

from distrib.config import DataConfig
from distrib.data import Augment, BatchPlan, DeviceBatches, Split, epoch_steps, load_data
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


def test_imagefolder_through_two_loader_workers_equals_the_device_path(tmp_path):
    """The same PNGs: data.name=imagefolder through DataLoader workers, and read by a factory as tensors onto the
    device path; with crop_flip, across epochs, a resume mid-epoch and an abandoned epoch, the same bits."""
    make_image_folder(tmp_path, classes=("a", "b", "c", "d"), per_class=(12, 3), size=(9, 8))
    common = dict(root=str(tmp_path), augment="crop_flip", crop_padding=3, eval_batch_size=5)
    loader = load_data(DataConfig(name="imagefolder", loader="dataloader", num_workers=2, **common),
                       _runtime(1, 2), seed=3, log=lambda m: None)
    device = load_data(DataConfig(factory="data_factories:png_tensors", kwargs={"root": str(tmp_path)},
                                  loader="device", **common), _runtime(1, 2), seed=3, log=lambda m: None)
    assert type(loader.train).__name__ == "LoaderBatches" and type(device.train).__name__ == "DeviceBatches"
    assert (loader.info.mean, loader.info.std) == (device.info.mean, device.info.std)
    plan = BatchPlan(48, 12, 2, 1, 2, seed=9)
    next(iter(epoch_steps(loader.train, plan, 0)))  # an epoch left unfinished must not disturb the next pass
    for epoch, start in ((0, 0), (1, 2), (2, 0)):
        a = list(epoch_steps(loader.train, plan, epoch, start))
        b = list(epoch_steps(device.train, plan, epoch, start))
        assert len(a) == len(b) == plan.steps_per_epoch - start
        for (xa, ya), (xb, yb) in zip([m for s in a for m in s], [m for s in b for m in s]):
            assert xa.shape == (3, 3, 8, 9) and torch.equal(xa, xb) and torch.equal(ya, yb)
    lists = [torch.arange(12)[:5], torch.arange(12)[5:]]
    for (xa, ya), (xb, yb) in zip(loader.test.batches(lists), device.test.batches(lists), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_crop_flip_training_agrees_at_world_sizes_1_and_2(tmp_path):
    """End to end through `distrib train`: the trainer passes (seed, epoch) to the data, so one process and two
    workers train on the same augmented batches; without augmentation the weights differ."""
    import os

    from support import REPO, assert_ok, distrib, load_weights, max_relative_diff

    from distrib import cli

    common = ["data.name=synthetic", "data.synthetic_shape=[3,12,12]", "data.synthetic_train_size=256",
              "data.synthetic_test_size=64", "model.factory=data_factories:tiny_cnn", "train.max_steps=12",
              "train.global_batch_size=32", "run.progress=false", "checkpoint.every_steps=0", "dist.device=cpu"]
    sets = lambda *items: [x for item in [*common, *items] for x in ("--set", item)]  # noqa: E731
    assert cli.main(["train", *sets("data.augment=crop_flip", f"run.dir={tmp_path / 'one'}")]) == 0
    assert cli.main(["train", *sets(f"run.dir={tmp_path / 'plain'}")]) == 0
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    assert_ok(distrib("train", "--nproc-per-node", "2", *sets("data.augment=crop_flip", f"run.dir={tmp_path / 'two'}"),
                      env=env, timeout=180))
    one, two = load_weights(tmp_path / "one"), load_weights(tmp_path / "two")
    assert max_relative_diff(two, one) < 1e-5
    assert max_relative_diff(load_weights(tmp_path / "plain"), one) > 1e-3


def test_bench_augment_runs_and_prints_its_table(capsys):
    """The bench's numbers are for scripts, not tests; here only that it runs and reports both kinds of rows."""
    import importlib.util

    from support import REPO

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
