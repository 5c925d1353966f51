"""Datasets by name and factory: small files in each real on-disk format (IDX plain and .gz, CIFAR-10 pickle
batches, an ImageFolder tree of PNGs) read through torchvision's loaders; every bad-data case one line."""

import gzip
import json
import shutil

import pytest
import torch

from distrib import cli
from distrib.config import DataConfig
from distrib.data import BatchPlan, eval_batches, idx, load_data, normalize
from distrib.data.tensors import channel_stats
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError
from tests.helpers.support import make_cifar_dir, make_idx_dir, make_image_folder

CPU = Runtime(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def _load(**kwargs):
    return load_data(DataConfig(**kwargs), CPU, seed=0, log=lambda message: None)


def _all(source, num_samples, batch_size=1000):
    inputs, targets = zip(*source.batches(eval_batches(num_samples, batch_size, 0, 1)))
    return torch.cat(inputs), torch.cat(targets)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_files_through_torchvision(tmp_path, gz):
    images, labels, test_images, test_labels = make_idx_dir(tmp_path, num_train=40, num_test=9, gz=gz)
    data = _load(name="mnist", root=str(tmp_path))
    assert (data.info.input_shape, data.info.num_classes, data.info.mean) == ((1, 28, 28), 10, (0.1307,))
    assert data.info.class_names[0] == "0 - zero"  # torchvision's MNIST names
    x, y = _all(data.test, data.test.num_samples)
    assert torch.equal(x, normalize(test_images.unsqueeze(1), ((0.1307,), (0.3081,)))) and torch.equal(y, test_labels)
    assert (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file()  # the cache: its own subfolder


@pytest.mark.parametrize("nested", [True, False])
def test_cifar10_pickle_batches_through_torchvision(tmp_path, nested):
    folder = tmp_path / "cifar-10-batches-py" if nested else tmp_path
    images, labels, test_images, test_labels = make_cifar_dir(folder, per_batch=6, num_test=7)
    data = _load(name="cifar10", root=str(tmp_path))
    assert data.info.input_shape == (3, 32, 32) and data.info.class_names[:2] == ("airplane", "automobile")
    assert data.train.num_samples == 30 and data.info.mean == (0.4914, 0.4822, 0.4465)
    x, y = _all(data.train, 30)
    mean, std = torch.tensor(data.info.mean).view(3, 1, 1), torch.tensor(data.info.std).view(3, 1, 1)
    assert torch.allclose(x, (images / 255 - mean) / std, atol=1e-5) and torch.equal(y, labels)


def test_imagefolder_of_pngs_with_statistics_from_the_data(tmp_path):
    expected = make_image_folder(tmp_path, per_class=(5, 2), size=(9, 7))
    data = _load(name="imagefolder", root=str(tmp_path))
    info = data.info
    assert (info.input_shape, info.num_classes, info.class_names) == ((3, 7, 9), 3, ("cat", "dog", "owl"))
    assert type(data.train).__name__ == "LoaderBatches"  # file-backed: the DataLoader path by default
    assert (info.mean, info.std) == channel_stats([expected["train"][0]])
    x, y = _all(data.test, data.test.num_samples, batch_size=4)
    mean, std = torch.tensor(info.mean).view(3, 1, 1), torch.tensor(info.std).view(3, 1, 1)
    assert torch.allclose(x, (expected["test"][0] / 255 - mean) / std, atol=1e-5)
    assert torch.equal(y, expected["test"][1])
    resized = _load(name="imagefolder", root=str(tmp_path), image_size=16, normalize="none", loader="device")
    assert resized.info.input_shape == (3, 16, 16) and resized.info.mean == (0.0,) * 3
    assert type(resized.train).__name__ == "DeviceBatches"


def test_synthetic_default_is_the_same_bits_as_ever():
    """Many tests compare runs on the default synthetic set: its images, labels and normalisation stay fixed."""
    g = torch.Generator().manual_seed(1234)
    prototypes = torch.rand(10, 28, 28, generator=g)
    g.manual_seed(1)
    labels = torch.randint(0, 10, (50,), generator=g)
    images = (prototypes[labels] + 0.35 * torch.randn(50, 28, 28, generator=g)).clamp(0, 1).mul(255).round()
    data = _load(name="synthetic", synthetic_train_size=50, synthetic_test_size=5)
    x, y = _all(data.train, 50)
    assert torch.equal(y, labels)
    assert torch.equal(x, torch.add(torch.tensor(-0.2860 / 0.3530), images.to(torch.uint8).unsqueeze(1),
                                    alpha=1 / (255 * 0.3530)))
    other = _load(name="synthetic", synthetic_shape=(3, 8, 6), num_classes=100, synthetic_train_size=300)
    assert other.info.input_shape == (3, 8, 6) and other.info.num_classes == 100
    assert len(other.info.class_names) == 100


def test_factory_datasets_and_tensor_pairs(tmp_path):
    pairs = _load(factory="tests.helpers.data_factories:pairs", kwargs={"n_train": 30, "num_classes": 4})
    assert pairs.info.name == "tests.helpers.data_factories:pairs" and pairs.info.input_shape == (3, 8, 8)
    assert type(pairs.train).__name__ == "LoaderBatches" and pairs.train.num_samples == 30
    tensors = _load(factory="tests.helpers.data_factories:tensors", kwargs={"n_train": 30, "num_classes": 4})
    assert type(tensors.train).__name__ == "DeviceBatches"
    assert tensors.info.num_classes == pairs.info.num_classes <= 4  # probed from the labels
    assert tensors.info.mean == pairs.info.mean  # computed from the same samples either way
    plan = BatchPlan(30, 10, 1, 0, 1, seed=0)
    idx_lists = plan.micro_batches(plan.order(0), 1)
    for (xa, ya), (xb, yb) in zip(pairs.train.batches(idx_lists), tensors.train.batches(idx_lists)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ---------------------------------------------------------------- bad data: one line each, naming path, value, fix


def _fails(match: str, **kwargs) -> str:
    with pytest.raises(UserError, match=match) as error:
        _load(**kwargs)
    message = str(error.value)
    assert "\n" not in message and "fix" in message, message
    return message


def _idx_root(tmp_path, gz=True):
    root = tmp_path / "data"
    make_idx_dir(root, num_train=20, num_test=5, gz=gz)
    return root


@pytest.mark.parametrize("case", ["empty", "truncated"])
def test_bad_gz_files_name_the_file(tmp_path, case):
    root = _idx_root(tmp_path)
    path = root / "train-images-idx3-ubyte.gz"
    path.write_bytes(b"" if case == "empty" else path.read_bytes()[:40])
    message = _fails("train-images-idx3-ubyte.gz", root=str(root))
    assert ("gzip" if case == "truncated" else "empty file") in message
    assert not (root / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").exists()  # nothing half-unpacked


def test_truncated_and_wrong_magic_idx_files(tmp_path):
    root = _idx_root(tmp_path, gz=False)
    images = root / "t10k-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])
    assert "truncated" in _fails("t10k-images-idx3-ubyte", root=str(root))
    images.unlink()
    make_idx_dir(root, num_train=20, num_test=5)
    labels = root / "train-labels-idx1-ubyte"
    labels.write_bytes(b"\x00\x00\x08\x03" + labels.read_bytes()[4:])
    assert "magic number 00000803" in _fails("train-labels-idx1-ubyte", root=str(root))


def test_bad_cache_is_rebuilt_once_the_source_is_fixed(tmp_path):
    """0-byte unpacked files (a broken source, an interrupted copy) are found and rebuilt from the source."""
    root = _idx_root(tmp_path)
    good = (root / "train-images-idx3-ubyte.gz").read_bytes()
    (root / "train-images-idx3-ubyte.gz").write_bytes(b"")
    _fails("train-images-idx3-ubyte.gz: an empty file", root=str(root))
    raw = root / "FashionMNIST" / "raw"
    for name in idx.RAW_FILES:
        (raw / name).write_bytes(b"")  # what an older version left behind
    (root / "train-images-idx3-ubyte.gz").write_bytes(good)
    data = _load(root=str(root))
    assert data.train.num_samples == 20 and idx.cache_problems(raw) == {}
    with gzip.open(root / "train-images-idx3-ubyte.gz") as f:
        assert (raw / "train-images-idx3-ubyte").read_bytes() == f.read()


def test_data_root_that_is_a_file(tmp_path):
    path = tmp_path / "data.tar"
    path.write_bytes(b"x")
    _fails(r"data.root = '.*data.tar': is a file, not a folder", root=str(path))


@pytest.mark.parametrize("holds, name", [("imagefolder", "fashion-mnist"), ("cifar", "fashion-mnist"),
                                         ("idx", "cifar10"), ("cifar", "imagefolder")])
def test_data_root_holding_another_dataset_is_refused(tmp_path, holds, name):
    root = tmp_path / "mine"
    {"imagefolder": lambda: make_image_folder(root, per_class=(1, 1)),
     "cifar": lambda: make_cifar_dir(root, per_batch=1, num_test=1),
     "idx": lambda: make_idx_dir(root, num_train=2, num_test=2)}[holds]()
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    message = _fails("data.root = .*mine.*: holds", name=name, root=str(root))
    assert "data.name=" in message
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before  # nothing written into the user's folder


@pytest.mark.parametrize("factory, match", [
    ("tests.helpers.data_factories:raises",
     r"data.factory = 'tests.helpers.data_factories:raises': calling it .* raised ValueError: no such"),
    ("tests.helpers.data_factory_broken:build",
     r"importing tests.helpers.data_factory_broken raised RuntimeError: this module needs"),
    ("tests.helpers.data_factories:missing", r"data_factories has no function missing"),
    ("tests.helpers.data_factories:returns_a_dict", r"returned a dict; fix: make it return \(train, test\)"),
    ("tests.helpers.data_factories:returns_strings", r"train: a str; fix: give \(train, test\)"),
    ("tests.helpers.data_factories:bad_samples", r"train: a list of 1 \(tuple\)"),
    ("tests.helpers.data_factories:mismatched", r"train inputs are \[3, 8, 8\] float, test inputs \[3, 4, 8\] float"),
])
def test_factory_mistakes(factory, match):
    _fails(match, factory=factory)


def test_labels_out_of_range_for_declared_classes():
    _fails(r"a train label is \d, out of range for 3 classes", factory="tests.helpers.data_factories:tensors",
           kwargs={"num_classes": 5, "n_train": 200}, num_classes=3)


def test_normalize_with_the_wrong_number_of_channels():
    _fails(r"data.normalize = .*2 values per list for data of 3 channels", name="synthetic",
           synthetic_shape=(3, 4, 4), normalize=((0.5, 0.5), (1.0, 1.0)))


@pytest.mark.parametrize("case", ["foreign", "factory", "gz"])
def test_train_refuses_bad_data_with_one_line_and_writes_nothing(tmp_path, capsys, case):
    root, run_dir = tmp_path / "data", tmp_path / "run"
    overrides = {"foreign": ["data.name=fashion-mnist"],
                 "factory": ["data.factory=tests.helpers.data_factories:returns_a_dict"], "gz": []}[case]
    if case == "foreign":
        make_image_folder(root, per_class=(1, 1))
    if case == "gz":
        _idx_root(tmp_path)
        (root / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b\x08")
    argv = ["train", "--set", f"data.root={root}", "--set", f"run.dir={run_dir}", "--set", "run.progress=false",
            "--set", "train.max_steps=2", *[x for o in overrides for x in ("--set", o)]]
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distrib: error")]
    assert len(err) == 1 and ("data.root" in err[0] or "data.factory" in err[0] or ".gz" in err[0]), err
    assert not run_dir.exists()


def test_a_train_run_on_cifar_batches_records_the_data(tmp_path):
    make_cifar_dir(tmp_path / "data", per_batch=8, num_test=10)
    argv = ["train", "--set", f"data.root={tmp_path}/data", "--set", "data.name=cifar10", "--set",
            f"run.dir={tmp_path}/run", "--set", "train.max_steps=2", "--set", "train.global_batch_size=8", "--set",
            "run.progress=false", "--set", "model.factory=tests.helpers.data_factories:tiny_cnn"]
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
    assert cli.main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"]["input_shape"] == [3, 32, 32] and summary["data"]["class_names"][0] == "airplane"


def test_imagefolder_mixed_modes_sizes_and_unreadable_files(tmp_path):
    from PIL import Image

    make_image_folder(tmp_path, per_class=(2, 1), size=(6, 6), mode="L")
    Image.new("RGB", (6, 6), (200, 10, 10)).save(tmp_path / "train" / "dog" / "zz_colour.png")
    data = _load(name="imagefolder", root=str(tmp_path), loader="device")
    assert data.info.input_shape == (1, 6, 6)  # grey like the first image: the colour one is converted
    Image.new("L", (7, 5)).save(tmp_path / "train" / "cat" / "zz_bigger.png")
    _fails(r"zz_bigger.png: 7x5 pixels where the first image has 6x6; fix: --set data.image_size=N", name="imagefolder",
           root=str(tmp_path), loader="device")
    (tmp_path / "train" / "cat" / "zz_bigger.png").write_bytes(b"not a png")
    _fails(r"zz_bigger.png: cannot be read as an image", name="imagefolder", root=str(tmp_path), image_size=6)


def test_class_folders_without_train_and_test_are_not_fashion_mnist(tmp_path):
    make_image_folder(tmp_path / "all", per_class=(1, 1))
    shutil.move(tmp_path / "all" / "train", tmp_path / "mine")
    message = _fails(r"holds image files \(imagefolder wants .*\), not Fashion-MNIST", root=str(tmp_path / "mine"))
    assert "data.name=imagefolder" in message and not (tmp_path / "mine" / "FashionMNIST").exists()


def test_load_inputs_for_prediction(tmp_path):
    from PIL import Image

    from distrib.data import DataInfo, load_inputs

    (tmp_path / "in" / "sub").mkdir(parents=True)
    Image.new("RGB", (20, 10), (255, 0, 0)).save(tmp_path / "in" / "b.png")
    Image.new("L", (8, 8), 0).save(tmp_path / "in" / "sub" / "a.jpg")
    (tmp_path / "in" / "notes.txt").write_text("not an image")
    info = DataInfo("x", (3, 8, 8), 2, ("a", "b"), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    paths, source = load_inputs(tmp_path / "in", info)
    assert paths == [str(tmp_path / "in" / "b.png"), str(tmp_path / "in" / "sub" / "a.jpg")]
    (x, y), = source.batches([torch.arange(2)])
    assert x.shape == (2, 3, 8, 8) and y.tolist() == [-1, -1]
    assert torch.allclose(x[0, 0], torch.full((8, 8), 2.0)) and torch.allclose(x[1], torch.full((3, 8, 8), -2.0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no image files"):
        load_inputs(tmp_path / "empty", info)


@pytest.mark.parametrize("override, match", [
    ("data.name=cifar100", r"data.name = 'cifar100': must be one of fashion-mnist, mnist, cifar10, imagefolder"),
    ("data.augment=rotate", r"data.augment = 'rotate': must be one of none, flip, crop_flip"),
    ("data.factory=mydata", r"data.factory = 'mydata': must look like package.module:function"),
    ("data.normalize=zscore", r"data.normalize = 'zscore': must be auto, none or \[\[means\], \[stds\]\]"),
    ("data.normalize=[[0.5],[0]]", r"data.normalize = \[\[0.5\], \[0.0\]\]: .* stds > 0"),
    ("data.normalize=[[0.5,0.5],[1]]", r"data.normalize = .*two lists of one number per channel"),
    ("data.synthetic_shape=[28,28]", r"data.synthetic_shape = \[28, 28\]: must be \[C, H, W\]"),
    ("data.prefetch_factor=0", r"data.prefetch_factor = 0: must be a finite number >= 1"),
])
def test_data_keys_are_checked_when_the_config_loads(override, match):
    from distrib.config import load_config
    from distrib.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_data_keys_round_trip_through_toml(tmp_path):
    from distrib.config import load_config, to_toml

    config = load_config(None, ["data.factory=pkg.data:build", "data.kwargs={size = 3, name = 'x'}",
                                "data.normalize=[[0.5,0.4,0.3],[0.2,0.2,0.2]]", "data.synthetic_shape=[3,32,32]"])
    assert config.data.normalize == ((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))
    assert config.data.kwargs == {"size": 3, "name": "x"}
    (tmp_path / "config.toml").write_text(to_toml(config))
    assert load_config(str(tmp_path / "config.toml")).data == config.data
