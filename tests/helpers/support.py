"""Shared test helpers: the one SMALL run, datasets written in their real on-disk formats, `distrib` and torchrun
commands through the one runner (processes.py, whose names are re-exported here), weight diffs."""

from __future__ import annotations

import contextlib
import gzip
import socket
import struct
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from distrib.training.trainer import Trainer
from tests.helpers.processes import EVENT_S, REPO, Done, Launches, kill_tree, run, run_one  # noqa: F401 - the one runner

# The one small run of the tests: synthetic data, two steps on the CPU, no progress bar, no periodic checkpoints; as
# section.key=value items. A test appends its own items (later ones win); sets() turns them into --set arguments.
SMALL = ("data.name=synthetic", "data.synthetic_train_size=256", "data.synthetic_test_size=64", "train.max_steps=2",
         "train.global_batch_size=32", "train.warmup_steps=2", "run.progress=false", "dist.device=cpu",
         "checkpoint.every_steps=0")


# SMALL with a validation set: 128 samples, 13 held out (data.val_fraction), 115 train, 3 steps an epoch of 32.
# min_delta 1.0: the first evaluation (step 3) is the best, the next two do not improve enough, so with patience 2
# the run stops after the evaluation at step 9.
VALIDATED = ("data.synthetic_train_size=128", "data.synthetic_test_size=50", "data.val_fraction=0.1",
             "train.max_steps=0", "train.epochs=10", "train.early_stop_metric=val_loss", "train.early_stop_patience=2",
             "train.early_stop_min_delta=1.0", "train.schedule=constant")


def sets(*overrides: str) -> list[str]:
    """["--set", item, ...] for `distrib train`."""
    return [arg for item in overrides for arg in ("--set", str(item))]


def small_config(run_dir: Path, *overrides: str):
    """SMALL plus overrides as a Config, writing to run_dir."""
    from distrib.config import load_config

    return load_config(None, [*SMALL, f"run.dir={run_dir}", *overrides])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_idx(path: Path, data: torch.Tensor, gz: bool = False) -> None:
    """The IDX format of (Fashion-)MNIST: magic (0, 0, type 0x08 = ubyte, ndim), big-endian dims, raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, data.dim()) + struct.pack(f">{data.dim()}I", *data.shape)
    payload = header + data.to(torch.uint8).contiguous().numpy().tobytes()
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(payload)


def make_idx_dir(directory: Path, num_train: int = 300, num_test: int = 101, gz: bool = False, seed: int = 0):
    """Four small Fashion-MNIST-format files; returns (train_images, train_labels, test_images, test_labels)."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    arrays = []
    for prefix, n in (("train", num_train), ("t10k", num_test)):
        images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        suffix = ".gz" if gz else ""
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", images, gz)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", labels, gz)
        arrays += [images, labels.long()]
    return tuple(arrays)


CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def make_cifar_dir(directory: Path, per_batch: int = 20, num_test: int = 30, seed: int = 0):
    """CIFAR-10's python version: pickled dicts of uint8 rows (3 x 32 x 32, channel-major) and labels, five training
    batches, a test batch and batches.meta; returns (train_images, train_labels, test_images, test_labels)."""
    import pickle

    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    arrays = []
    for names, n in ((("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"), per_batch),
                     (("test_batch",), num_test)):
        images, labels = [], []
        for name in names:
            x = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
            y = torch.randint(0, 10, (n,), generator=g)
            with open(directory / name, "wb") as f:
                pickle.dump({"batch_label": name, "data": x.reshape(n, -1).numpy(), "labels": y.tolist()}, f)
            images.append(x)
            labels.append(y)
        arrays += [torch.cat(images), torch.cat(labels)]
    with open(directory / "batches.meta", "wb") as f:
        pickle.dump({"label_names": list(CIFAR_CLASSES), "num_vis": 3072}, f)
    return tuple(arrays)


def make_image_folder(root: Path, classes=("cat", "dog", "owl"), per_class=(8, 4), size=(12, 10), mode="RGB",
                      seed: int = 0):
    """An ImageFolder tree of PNGs: root/train/CLASS/*.png and root/test/CLASS/*.png with random pixels; returns
    {split: (images uint8 (N, C, H, W), labels)} in ImageFolder's order (classes sorted, then file names)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    channels = 1 if mode == "L" else 3
    out = {}
    for split, count in zip(("train", "test"), per_class):
        images, labels = [], []
        for label, name in enumerate(sorted(classes)):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                x = torch.randint(0, 256, (channels, size[1], size[0]), generator=g, dtype=torch.uint8)
                array = x[0].numpy() if channels == 1 else x.permute(1, 2, 0).numpy()
                Image.fromarray(array, mode).save(root / split / name / f"{i:03d}.png")
                images.append(x)
                labels.append(label)
        out[split] = (torch.stack(images), torch.tensor(labels))
    return out


def distrib(*args: str, timeout: float = EVENT_S, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "distrib", *args], timeout, **kw)


def torchrun_train(nproc: int, *args: str, timeout: float = EVENT_S, **kw) -> subprocess.CompletedProcess:
    """`torchrun --standalone` (a free port of its own) running `python -m distrib train` on nproc workers."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "distrib", "train", *args]
    return run(cmd, timeout, **kw)


def load_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "model.pt", weights_only=True, map_location="cpu")


def max_relative_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)).item() for k in a)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under folder and its bytes, but the lock files (a run's lock, not its output)."""
    from distrib.launch.rundir import LOCK_NAME

    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def count_host_reads(monkeypatch) -> list[tuple[int, str]]:
    """The (step, method) of every host read made inside Trainer.step, filled in as the run goes. On an accelerator
    each one would stall the device's queue of work; the CPU takes the same path, so the CPU tests prove it."""
    reads, current = [], []
    for name in ("item", "tolist", "__bool__", "__float__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, _name=name:
                            (current and reads.append((current[-1], _name))) or _real(t, *a))
    real_step = Trainer.step

    def step(self, micro_batches):
        current.append(self.state.progress.step + 1)
        try:
            return real_step(self, micro_batches)
        finally:
            current.pop()

    monkeypatch.setattr(Trainer, "step", step)
    return reads


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """This process as rank `rank` of a fake group: meshes and DTensors as on that rank, collectives return at once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
