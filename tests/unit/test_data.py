"""Data: real IDX files through torchvision's loader, offline sources, the batch plan, and the two loader paths."""

from pathlib import Path

import pytest
import torch

from distrib import data
from distrib.config import DataConfig
from distrib.data import BatchPlan, idx
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError, UserError
from tests.helpers.support import make_idx_dir

CPU = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def prepare_fashion_mnist(root: Path) -> str | None:
    try:
        idx.prepare("fashion-mnist", root, lambda message: None, idx.download)
    except UserError as e:
        return str(e)
    return None


def _no_download(monkeypatch, system_dirs):
    monkeypatch.setitem(idx.SYSTEM_DIRS, "fashion-mnist", system_dirs)
    monkeypatch.setattr(idx, "download", lambda name, root: pytest.fail("must not download"))


def _load(root: Path):
    from torchvision.datasets import FashionMNIST

    return [FashionMNIST(str(root), train=t, download=False) for t in (True, False)]


@pytest.mark.parametrize("gz", [True, False])
def test_offline_system_dir_is_unpacked_for_torchvision(tmp_path, monkeypatch, gz):
    """Debian ships re-gzipped IDX files; they are unpacked once into root/FashionMNIST/raw and read by torchvision."""
    system = tmp_path / "usr-share-datasets"
    expected = make_idx_dir(system, gz=gz)
    _no_download(monkeypatch, [system])
    root = tmp_path / "data"
    assert prepare_fashion_mnist(root) is None
    assert sorted(p.name for p in (root / "FashionMNIST" / "raw").iterdir()) == sorted(idx.RAW_FILES)
    train, test = _load(root)
    for got, want in zip((train.data, train.targets, test.data, test.targets), expected):
        assert torch.equal(got, want)
    assert prepare_fashion_mnist(root) is None  # second time: already there


def test_files_directly_in_data_root_win_over_the_system_dir(tmp_path, monkeypatch):
    root_files = make_idx_dir(tmp_path / "data", num_train=50, seed=1)
    make_idx_dir(tmp_path / "system", num_train=60, seed=2, gz=True)
    monkeypatch.setitem(idx.SYSTEM_DIRS, "fashion-mnist", [tmp_path / "system"])
    assert prepare_fashion_mnist(tmp_path / "data") is None
    assert torch.equal(_load(tmp_path / "data")[0].data, root_files[0])


def test_download_is_the_last_resort_and_its_failure_says_where_it_looked(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setitem(idx.SYSTEM_DIRS, "fashion-mnist", [tmp_path / "none"])
    monkeypatch.setattr(idx, "download", lambda name, root: calls.append(root) or (_ for _ in ()).throw(OSError()))
    message = prepare_fashion_mnist(tmp_path / "data")
    assert calls == [tmp_path / "data"]
    assert str(tmp_path / "none") in message and "FashionMNIST/raw" in message


@pytest.mark.parametrize("world_size, accum", [(1, 1), (2, 2), (3, 1), (4, 2)])
def test_shards_are_disjoint_cover_the_data_and_match_any_world_size(world_size, accum):
    n, gbs = 1000, 48
    single = BatchPlan(n, gbs, 1, 0, 1, seed=7)
    plans = [BatchPlan(n, gbs, accum, rank, world_size, seed=7) for rank in range(world_size)]
    order = single.order(0)
    for step in range(single.steps_per_epoch):
        pieces = [idx for p in plans for idx in p.micro_batches(order, step)]
        assert all(len(idx) == gbs // (world_size * accum) for idx in pieces)
        got = torch.cat(pieces)
        assert len(set(got.tolist())) == gbs  # disjoint within the step
        assert torch.equal(got.sort().values, single.micro_batches(order, step)[0].sort().values)
    used = torch.cat([idx for p in plans for s in range(p.steps_per_epoch) for idx in p.micro_batches(order, s)])
    assert sorted(used.tolist()) == sorted(order[: single.steps_per_epoch * gbs].tolist())  # covers; no repeats


def test_a_new_epoch_reorders_and_the_order_is_reproducible():
    plan = BatchPlan(500, 50, 1, 0, 1, seed=3)
    assert not torch.equal(plan.order(0), plan.order(1))
    assert torch.equal(plan.order(1), BatchPlan(500, 50, 1, 0, 1, seed=3).order(1))
    assert not torch.equal(plan.order(0), BatchPlan(500, 50, 1, 0, 1, seed=4).order(0))


def test_plan_rejects_batches_that_do_not_divide():
    with pytest.raises(ConfigError, match="train.global_batch_size = 50.*world_size \\(3\\).*use 48 or 51"):
        BatchPlan(500, 50, 1, 0, 3, seed=0)


def test_synthetic_data_is_seeded_and_the_same_each_time():
    config = DataConfig(name="synthetic", synthetic_train_size=100, synthetic_test_size=10)
    (a, at), (b, _) = data.load_splits(config, CPU), data.load_splits(config, CPU)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs[:10], at.inputs)  # train and test differ


def test_train_end_to_end_on_idx_files_through_the_real_loader(tmp_path, monkeypatch):
    import json

    from distrib import cli

    make_idx_dir(tmp_path / "data", num_train=256, num_test=77, gz=True)
    _no_download(monkeypatch, [])
    argv = ["train", "--set", f"data.root={tmp_path}/data", "--set", f"run.dir={tmp_path}/run", "--set",
            "train.max_steps=3", "--set", "train.global_batch_size=64", "--set", "run.progress=false"]
    assert cli.main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test_count"] == 77 and summary["steps"] == 3
