"""Augmentation on the device, keyed by (seed, epoch, sample index): torchvision's per-sample ops as the reference,
the same batches at world sizes 1, 2 and 3 and after a resume, and bitwise-equal DataLoader and device paths."""

import torch

from distrib.config import DataConfig
from distrib.data import BatchPlan, epoch_steps, load_data
from distrib.distributed.runtime import Runtime
from tests.helpers.processes import EVENT_S
from tests.helpers.support import make_image_folder


def _runtime(rank: int = 0, world_size: int = 1) -> Runtime:
    return Runtime(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")


def test_imagefolder_through_two_loader_workers_equals_the_device_path(tmp_path):
    """The same PNGs: data.name=imagefolder through DataLoader workers, and read by a factory as tensors onto the
    device path; with crop_flip, across epochs, a resume mid-epoch and an abandoned epoch, the same bits."""
    make_image_folder(tmp_path, classes=("a", "b", "c", "d"), per_class=(12, 3), size=(9, 8))
    common = dict(root=str(tmp_path), augment="crop_flip", crop_padding=3, eval_batch_size=5)
    loader = load_data(DataConfig(name="imagefolder", loader="dataloader", num_workers=2, **common),
                       _runtime(1, 2), seed=3, log=lambda m: None)
    device = load_data(DataConfig(factory="tests.helpers.data_factories:png_tensors", kwargs={"root": str(tmp_path)},
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

    from distrib import cli
    from tests.helpers.support import REPO, assert_ok, distrib, load_weights, max_relative_diff

    common = ["data.name=synthetic", "data.synthetic_shape=[3,12,12]", "data.synthetic_train_size=256",
              "data.synthetic_test_size=64", "model.factory=tests.helpers.data_factories:tiny_cnn",
              "train.max_steps=12", "train.global_batch_size=32", "run.progress=false", "checkpoint.every_steps=0",
              "dist.device=cpu"]
    sets = lambda *items: [x for item in [*common, *items] for x in ("--set", item)]  # noqa: E731
    assert cli.main(["train", *sets("data.augment=crop_flip", f"run.dir={tmp_path / 'one'}")]) == 0
    assert cli.main(["train", *sets(f"run.dir={tmp_path / 'plain'}")]) == 0
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    assert_ok(distrib("train", "--nproc-per-node", "2", *sets("data.augment=crop_flip", f"run.dir={tmp_path / 'two'}"),
                      env=env, timeout=EVENT_S))
    one, two = load_weights(tmp_path / "one"), load_weights(tmp_path / "two")
    assert max_relative_diff(two, one) < 1e-5
    assert max_relative_diff(load_weights(tmp_path / "plain"), one) > 1e-3
