"""Datasets and this rank's shard: Fashion-MNIST (offline sources, then a rank-0 download) or a synthetic set,
the world-size-invariant batch plan, and two loader paths (device-resident, DataLoader) that yield identical batches."""

from __future__ import annotations

import gzip
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from distrib.config import DataConfig, TrainConfig
from distrib.errors import ConfigError, UserError
from distrib.runtime import Runtime

# Debian's dataset-fashion-mnist package; re-gzipped, so torchvision's md5 check rejects the .gz files as they are.
SYSTEM_DIRS = [Path("/usr/share/datasets/fashion-mnist")]
RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel statistics
_SHIFT, _SCALE = torch.tensor(-MEAN / STD), 1 / (255 * STD)  # (x / 255 - MEAN) / STD = x * _SCALE + _SHIFT


@dataclass(frozen=True)
class Split:
    """A whole split in memory, as torchvision stores it: uint8 images (N, 28, 28) and int64 labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def nbytes(self) -> int:
        return self.images.nbytes + self.labels.nbytes


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 28, 28) -> float32 (N, 1, 28, 28), on whatever device the images are; both loader paths use it."""
    # One fused kernel (uint8 in, float32 out: the 0-dim float _SHIFT sets the type) instead of four passes;
    # it was a third of the trainer's overhead over a hand-written loop on a CPU step (scripts/bench.py).
    return torch.add(_SHIFT, images.unsqueeze(1), alpha=_SCALE)


# ---------------------------------------------------------------- sources


def _raw_dir(root: Path) -> Path:
    return root / "FashionMNIST" / "raw"


def _copy_in(source: Path, raw: Path) -> bool:
    """Puts the four IDX files of `source` (plain or .gz) into torchvision's raw folder; False if any is missing."""
    found = {}
    for name in RAW_FILES:
        for candidate in (source / name, source / f"{name}.gz"):
            if candidate.is_file():
                found[name] = candidate
                break
    if len(found) < len(RAW_FILES):
        return False
    raw.mkdir(parents=True, exist_ok=True)
    for name, src in found.items():
        tmp = raw / f".{name}.partial"
        opener = gzip.open if src.suffix == ".gz" else open
        with opener(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout)
        os.replace(tmp, raw / name)  # whole files only: a crash never leaves a half-unpacked IDX file
    return True


def _download(root: Path) -> None:
    from torchvision.datasets import FashionMNIST

    for train in (True, False):
        FashionMNIST(str(root), train=train, download=True)


def prepare_fashion_mnist(root: Path) -> str | None:
    """Makes root/FashionMNIST/raw hold the IDX files; returns None on success or the one-line reason it could not."""
    raw = _raw_dir(root)
    if all((raw / name).is_file() for name in RAW_FILES):
        return None
    for source in [root, *SYSTEM_DIRS]:
        if _copy_in(source, raw):
            return None
    try:
        _download(root)
        return None
    except Exception as e:  # noqa: BLE001 - any failure becomes the one clear message below
        looked = ", ".join(str(p) for p in [raw, root, *SYSTEM_DIRS])
        return (f"data.root = {str(root)!r}: Fashion-MNIST not found (looked in {looked}) and the download failed "
                f"({type(e).__name__}); fix: apt-get install dataset-fashion-mnist, or put the four IDX files in "
                f"{raw}, or use --set data.name=synthetic")


def _fashion_mnist(root: Path, runtime: Runtime) -> tuple[Split, Split]:
    # Rank 0 alone unpacks or downloads; every rank takes part in the broadcast, which is also the wait.
    message = [prepare_fashion_mnist(root) if runtime.is_main else None]
    dist.broadcast_object_list(message, src=0)
    if message[0]:
        raise UserError(message[0])
    from torchvision.datasets import FashionMNIST

    splits = [FashionMNIST(str(root), train=train, download=False) for train in (True, False)]
    return tuple(Split(s.data, s.targets) for s in splits)


def _synthetic_split(size: int, seed: int) -> Split:
    """Ten fixed blurry prototypes plus noise: learnable, seeded, and the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    prototypes = torch.rand(10, 28, 28, generator=g)
    g.manual_seed(seed)
    labels = torch.randint(0, 10, (size,), generator=g)
    noisy = prototypes[labels] + 0.35 * torch.randn(size, 28, 28, generator=g)
    images = noisy.clamp(0, 1).mul(255).round().to(torch.uint8)
    return Split(images, labels)


def load_splits(config: DataConfig, runtime: Runtime) -> tuple[Split, Split]:
    """(train, test) splits in host memory, identical on every rank."""
    if config.name == "synthetic":
        return _synthetic_split(config.synthetic_train_size, 1), _synthetic_split(config.synthetic_test_size, 2)
    return _fashion_mnist(Path(config.root), runtime)


# ---------------------------------------------------------------- the batch plan


@dataclass(frozen=True)
class BatchPlan:
    """Which samples this rank uses at each step. Every epoch has one permutation from (seed, epoch) shared by all
    ranks; global batch k is the same set of samples at any world size; each rank takes its contiguous slice."""

    num_samples: int
    global_batch_size: int
    grad_accum_steps: int
    rank: int
    world_size: int
    seed: int

    def __post_init__(self):
        parts = self.world_size * self.grad_accum_steps
        if self.global_batch_size % parts:
            low = self.global_batch_size // parts * parts or parts
            raise ConfigError(
                f"train.global_batch_size = {self.global_batch_size}: must divide into world_size "
                f"({self.world_size}) x train.grad_accum_steps ({self.grad_accum_steps}) = {parts} equal "
                f"micro-batches; "
                f"use {low} or {low + parts}")
        if self.steps_per_epoch == 0:
            raise ConfigError(f"train.global_batch_size = {self.global_batch_size}: larger than the training set "
                              f"({self.num_samples} samples); use at most {self.num_samples}")

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // (self.world_size * self.grad_accum_steps)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size  # the last partial global batch is dropped

    def order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def micro_batches(self, order: torch.Tensor, step_in_epoch: int) -> list[torch.Tensor]:
        """This rank's grad_accum_steps index tensors for one optimizer step; O(1), no replay of earlier steps."""
        per_rank = self.global_batch_size // self.world_size
        start = step_in_epoch * self.global_batch_size + self.rank * per_rank
        return list(order[start:start + per_rank].split(self.micro_batch_size))


def make_plan(num_samples: int, train: TrainConfig, runtime: Runtime) -> BatchPlan:
    return BatchPlan(num_samples, train.global_batch_size, train.grad_accum_steps, runtime.rank,
                     runtime.world_size, train.seed)


def eval_batches(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's evaluation batches: the test set cut into fixed global batches, dealt out as contiguous runs.
    No padding and no duplicates, so ranks may get uneven shares; each sample sits in the same batch at any
    world size, so its logits are the same bits."""
    batches = list(torch.arange(num_samples).split(batch_size))
    lo, hi = rank * len(batches) // world_size, (rank + 1) * len(batches) // world_size
    return batches[lo:hi]


# ---------------------------------------------------------------- the two loader paths

Batch = tuple[torch.Tensor, torch.Tensor]


class DeviceBatches:
    """The whole uint8 split moved to the device once; batches are sliced by index and normalised there."""

    def __init__(self, split: Split, runtime: Runtime):
        self.images = split.images.to(runtime.device)
        self.labels = split.labels.to(runtime.device)
        self.device = runtime.device

    def batches(self, index_lists: list[torch.Tensor]) -> Iterator[Batch]:
        if not index_lists:
            return
        # One copy of all the indices: from pageable memory, a copy per step would wait for the device's queue.
        indices = torch.cat(index_lists).to(self.device, non_blocking=True)
        for idx in indices.split([len(i) for i in index_lists]):
            # index_select copies whole rows; images[idx] gathers uint8 byte by byte on the CPU, 14x slower (bench)
            yield normalize(self.images.index_select(0, idx)), self.labels.index_select(0, idx)


class _Indexed(Dataset):
    def __init__(self, split: Split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitems__(self, indices):  # one gather per batch instead of one call per sample
        idx = torch.as_tensor(indices)
        return self.split.images.index_select(0, idx), self.split.labels.index_select(0, idx)  # whole rows


def _collate(batch):
    return batch


class LoaderBatches:
    """A DataLoader over host memory for data that does not fit on the device; same indices, same batches."""

    def __init__(self, split: Split, runtime: Runtime, num_workers: int):
        self.dataset = _Indexed(split)
        self.device = runtime.device
        self.num_workers = num_workers
        self.pin_memory = runtime.pin_memory

    def batches(self, index_lists: list[torch.Tensor]) -> Iterator[Batch]:
        loader = DataLoader(self.dataset, batch_sampler=[idx.tolist() for idx in index_lists],
                            collate_fn=_collate, num_workers=self.num_workers, pin_memory=self.pin_memory)
        for images, labels in loader:
            yield (normalize(images.to(self.device, non_blocking=True)),
                   labels.to(self.device, non_blocking=True))


def make_batches(split: Split, config: DataConfig, runtime: Runtime, total_bytes: int):
    """The device-resident path by default when the data takes under half the device's free memory."""
    fits = total_bytes < runtime.free_memory_bytes() // 2
    if config.loader == "device" or (config.loader == "auto" and fits):
        return DeviceBatches(split, runtime)
    return LoaderBatches(split, runtime, config.num_workers)


def epoch_steps(source, plan: BatchPlan, epoch: int, start_step: int = 0) -> Iterator[list[Batch]]:
    """This rank's micro-batches for each remaining step of `epoch`, starting at `start_step` without replay."""
    order = plan.order(epoch)
    steps = range(start_step, plan.steps_per_epoch)
    batches = source.batches([idx for step in steps for idx in plan.micro_batches(order, step)])
    for _ in steps:
        yield [next(batches) for _ in range(plan.grad_accum_steps)]
