"""What a dataset is once loaded: DataInfo (shape, classes, normalisation: recorded in the outputs), in-memory splits,
and the normalisation both batch sources apply on the device (one fused kernel for uint8 images; images only)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch

from distrib.data import samples
from distrib.data.samples import Tree
from distrib.errors import UserError

FASHION_MNIST_STATS = ((0.2860,), (0.3530,))  # Fashion-MNIST training-set pixel statistics (0..1 units)
MAX_STATS_SAMPLES = 10_000  # data.normalize=auto on other sets: the statistics of at most this many samples


@dataclass(frozen=True)
class DataInfo:
    """What a model and inference need to know about the data; recorded in summary.json, model.json, checkpoints."""

    name: str
    input_shape: tuple[int, ...]  # of one input tensor: (C, H, W) for images, (T,) for tokens; () for dict samples
    num_classes: int  # integer targets: the number of classes (or of token ids); 0 for float targets or none
    class_names: tuple[str, ...]
    mean: tuple[float, ...]  # per channel, subtracted after uint8 images are scaled to 0..1; () = inputs as given
    std: tuple[float, ...]  # per channel, divided by
    inputs: str = ""  # what one sample's inputs are, e.g. 'int64 [64]' or '{input_ids: int64 [64], labels: ...}'
    targets: str = ""  # what one sample's targets are, e.g. 'int64 []' (a class), 'float32 [6]'; 'none'

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Split:
    """A whole split in memory: inputs and targets whose first dimension is the sample (N, ...), each a tensor or
    a dict of tensors; targets None for dict samples (their "labels" entry is the targets)."""

    inputs: Tree
    targets: Tree | None

    def __len__(self) -> int:
        return samples.num_rows(self.inputs)

    def nbytes(self) -> int:
        return samples.nbytes(self.inputs) + samples.nbytes(self.targets)

    def rows(self, index: torch.Tensor) -> tuple[Tree, Tree | None]:
        """(inputs, targets) of the samples `index`, as stored (targets None for dict samples)."""
        return samples.select(self.inputs, index), samples.select(self.targets, index)


class Normalizer:
    """x -> (x / pixel - mean) / std per channel, where pixel = 255 for uint8 images and 1 for float inputs. No mean
    (inputs that are not images, or a dict): the inputs pass as given."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], uint8: bool):
        pixel = 255 if uint8 else 1  # uint8 images count in 1/255ths
        self.as_given = not mean
        self.identity = not uint8 and all(m == 0 for m in mean) and all(s == 1 for s in std)
        self.single = len(set(mean)) == 1 and len(set(std)) == 1
        # The same floats as the seed's (x / 255 - MEAN) / STD = x * SCALE + SHIFT, computed in double precision.
        self.scale = [1 / (pixel * s) for s in std]
        self.shift = [-m / s for m, s in zip(mean, std)]
        self._shift0 = torch.tensor(self.shift[0]) if mean else None
        self._tensors: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: Tree) -> Tree:
        if self.as_given:
            return x
        if self.identity:
            return x.float()
        if self.single:
            # One fused kernel (uint8 in, float32 out: the 0-dim float shift sets the type) instead of four passes;
            # it was a third of the trainer's overhead over a hand-written loop on a CPU step (scripts/bench.py).
            return torch.add(self._shift0, x, alpha=self.scale[0])
        shift, scale = self._on(x.device)
        view = (-1, *[1] * (x.dim() - 2))
        return torch.mul(x, scale.view(view)).add_(shift.view(view))  # uint8 * float32 -> float32: two passes

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tensors:
            self._tensors[device] = (torch.tensor(self.shift, device=device), torch.tensor(self.scale, device=device))
        return self._tensors[device]


def normalize(images: torch.Tensor, stats=FASHION_MNIST_STATS) -> torch.Tensor:
    """uint8 images -> float32 normalised with `stats` (Fashion-MNIST's by default), on the images' device."""
    return Normalizer(*stats, uint8=images.dtype == torch.uint8)(images)


def check_inputs(what: str, inputs: Tree, targets: Tree) -> None:
    """The one place that says which tensors a split may hold: any dtype and shape, one row per sample."""
    rows = {name: samples.num_rows(tree) for name, tree in (("inputs", inputs), ("targets", targets))}
    for name, count in rows.items():
        if isinstance(count, set):
            raise UserError(f"{what}: the {name} {samples.kind(inputs if name == 'inputs' else targets, rows=True)} "
                            "have different numbers of rows; fix: give every tensor one row per sample")
    if rows["inputs"] != rows["targets"] or rows["inputs"] == 0:
        raise UserError(f"{what}: {rows['inputs']} inputs and {rows['targets']} targets "
                        f"({samples.kind(inputs, rows=True)} and {samples.kind(targets, rows=True)}); fix: give one "
                        "target per input, and at least one sample")


def stats_indices(num_samples: int) -> torch.Tensor:
    """Evenly spaced samples for data.normalize=auto: the same ones whichever path loads the data."""
    count = min(num_samples, MAX_STATS_SAMPLES)
    return torch.arange(count) * num_samples // count


def channel_stats(batches: Iterable[torch.Tensor]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (0..1 units for uint8) over batches of inputs. uint8 sums are exact integers, so
    the result does not depend on how the samples were batched (the DataLoader and device paths agree bitwise)."""
    total = squares = None
    count, uint8 = 0, False
    for x in batches:
        uint8 = x.dtype == torch.uint8
        flat = x.transpose(0, 1).reshape(x.shape[1], -1) if x.dim() == 4 else x.reshape(1, -1)
        flat = flat.long() if uint8 else flat.double()
        total = flat.sum(1) if total is None else total + flat.sum(1)
        squares = flat.square().sum(1) if squares is None else squares + flat.square().sum(1)
        count += flat.shape[1]
    scale = 255.0 if uint8 else 1.0
    mean = [t / count for t in total.tolist()]
    var = [max(s / count - m * m, 0.0) for s, m in zip(squares.tolist(), mean)]
    return tuple(m / scale for m in mean), tuple(max(v ** 0.5 / scale, 1e-6) for v in var)
