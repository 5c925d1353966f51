"""What the data is, learnt from its first sample and its splits (on rank 0, for every rank): whether the targets are
classes, how many and their names, and the image inputs' per-channel statistics."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from distrib.config import DataConfig
from distrib.data import samples
from distrib.data.batching import collate, init_worker
from distrib.data.materialize import checked
from distrib.data.tensors import DataInfo, Split, channel_stats, stats_indices
from distrib.errors import UserError

Stats = tuple[tuple[float, ...], tuple[float, ...]]
IGNORE_INDEX = -100  # a dense class target that is not counted (cross-entropy's ignore_index, Hugging Face's)


def describe(name: str, train, test, first, config: DataConfig, class_names: tuple[str, ...] | None,
             stats: Stats | None) -> DataInfo:
    """The DataInfo of the splits as they will be batched; class_names and stats: what the data came with (a named
    set's, a dataset's `classes`), else learnt here."""
    inputs, targets = first
    classes = _is_class(targets)
    num_classes, names = _classes(class_names, train, test, config, targets.dim() > 1) if classes else (0, ())
    mean, std = _stats(stats, train, inputs, config)
    shape = tuple(inputs.shape[1:]) if isinstance(inputs, torch.Tensor) else ()
    return DataInfo(name, shape, num_classes, names, mean, std, samples.kind(inputs), samples.kind(targets))


def _is_class(targets) -> bool:
    """Integer targets are class indices (one per sample, or per position); float targets are values."""
    return isinstance(targets, torch.Tensor) and not targets.is_floating_point() and targets.dtype != torch.bool


def _cheap_targets(split) -> torch.Tensor | None:
    if isinstance(split, Split):
        return samples.resolve(split.inputs, split.targets)[1]
    targets = getattr(split, "targets", None)
    return torch.as_tensor(targets).long() if targets is not None and len(targets) == len(split) else None


def _all_targets(split) -> torch.Tensor:
    """A Dataset that says nothing about its targets: read them once (flat: samples may differ in length; none where
    the samples have none, as when a collate function makes the labels)."""
    found = (samples.resolve(*samples.as_pair(split[i]))[1] for i in range(len(split)))
    return torch.cat([torch.zeros(0, dtype=torch.long), *(y.reshape(-1) for y in found if y is not None)])


def _classes(names: tuple[str, ...] | None, train, test, config: DataConfig, dense: bool
             ) -> tuple[int, tuple[str, ...]]:
    labels = {what: _cheap_targets(split) for what, split in (("train", train), ("test", test))}
    num_classes = config.num_classes or (len(names) if names else 0)
    if not num_classes:
        if labels["train"] is None:
            labels["train"] = _all_targets(train)
        counted = [_counted(y) for y in labels.values() if y is not None]
        num_classes = max(int(y.max()) if len(y) else -1 for y in counted) + 1
    for what, y in labels.items():
        y = _counted(y) if dense and y is not None else y  # dense targets: IGNORE_INDEX marks positions not counted
        if y is not None and len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
            noun = "target" if dense else "label"
            raise UserError(f"data: a {what} {noun} is {bad}, out of range for {num_classes} classes (data.num_classes "
                            f"= {config.num_classes}, 0 = from the data); fix: targets 0..{num_classes - 1}"
                            + (f" or {IGNORE_INDEX} (not counted)" if dense else "") + ", or set data.num_classes "
                            "(integer targets are classes: give float targets for a regression)")
    if not names or len(names) != num_classes:
        names = tuple(str(i) for i in range(num_classes))
    return num_classes, tuple(str(n) for n in names)


def _counted(targets: torch.Tensor) -> torch.Tensor:
    flat = targets.reshape(-1)
    return flat[flat != IGNORE_INDEX]


def _stats(stats: Stats | None, train, inputs, config: DataConfig) -> Stats:
    """Per-channel statistics of image inputs; () for anything else, whose inputs pass as given."""
    image = samples.is_image(inputs, per_sample=False)
    if config.normalize == "none" or not image and config.normalize == "auto":
        channels = inputs.shape[1] if image else 0
        return (0.0,) * channels, (1.0,) * channels
    if not image and not (isinstance(inputs, torch.Tensor) and (inputs.is_floating_point()
                                                               or inputs.dtype == torch.uint8)):
        raise UserError(f"data.normalize = {[list(m) for m in config.normalize]}: the inputs are "
                        f"{samples.kind(inputs)}, which cannot be normalised; fix: --set data.normalize=none")
    channels = inputs.shape[1] if image else 1
    if config.normalize != "auto":
        mean, std = config.normalize
        if len(mean) not in (1, channels):
            raise UserError(f"data.normalize = {[list(mean), list(std)]}: {len(mean)} values per list for data of "
                            f"{channels} channels; fix: give 1 or {channels} means and stds")
        return tuple(mean) * (channels // len(mean)), tuple(std) * (channels // len(std))
    if stats is not None:
        mean, std = stats
        return (tuple(mean) * channels, tuple(std) * channels) if len(mean) == 1 else (mean, std)
    indices = stats_indices(len(train))
    if isinstance(train, Split):
        return channel_stats(train.inputs.index_select(0, chunk) for chunk in indices.split(1024))
    loader = DataLoader(torch.utils.data.Subset(train, indices.tolist()), batch_size=256, collate_fn=collate,
                        num_workers=config.num_workers, worker_init_fn=init_worker)
    return channel_stats(checked(batch)[0] for batch in loader)
