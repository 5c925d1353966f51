"""From splits as read to Data: the loader path chosen once for both splits, input shape, classes and
normalisation probed once (rank 0) and the same on every rank, and the two batch sources built."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from distrib.config import DataConfig
from distrib.data import samples
from distrib.data.augment import Augment
from distrib.data.batching import BatchSource, DeviceBatches, Failed, Finish, LoaderBatches, collate, init_worker
from distrib.data.collate import Collate, probe, with_mask
from distrib.data.stream import StreamBatches, is_sharded, is_stream
from distrib.data.stream_read import as_split, rows_of
from distrib.data.tensors import DataInfo, Normalizer, Split, channel_stats, stats_indices
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError

Stats = tuple[tuple[float, ...], tuple[float, ...]]
STREAM_HEAD = 256  # a stream's first samples: where its kind, classes and image statistics are learnt
IGNORE_INDEX = -100  # a dense class target that is not counted (cross-entropy's ignore_index, Hugging Face's)


@dataclass(frozen=True)
class Data:
    info: DataInfo
    train: BatchSource
    test: BatchSource
    val: BatchSource | None = None  # a validation set (distrib.data.split): evaluated during training instead of test
    identity: Callable[[], dict] | None = None  # what identifies the data in a checkpoint (distrib.data.identity)


@dataclass(frozen=True)
class Loaded:
    """Both splits on the host, as read: Splits (tensors) or Datasets (file-backed)."""

    name: str
    train: Split | Dataset
    test: Split | Dataset
    class_names: tuple[str, ...] | None = None
    stats: Stats | None = None  # known for named sets
    val: Split | Dataset | None = None  # a validation set given with the data (a factory's third, fit's val_data)


def distributed(runtime: Runtime | None) -> bool:
    return runtime is not None and runtime.world_size > 1 and dist.is_initialized()


def on_rank0(runtime: Runtime | None, fn):
    """fn's result on rank 0, broadcast to every rank (the others wait in the broadcast); errors likewise."""
    message = [None, None]
    if runtime is None or runtime.is_main or not distributed(runtime):  # no process group: every caller runs it
        try:
            message[0] = fn()
        except UserError as e:
            message[1] = str(e)
    if distributed(runtime):
        dist.broadcast_object_list(message, src=0)
    if message[1]:
        raise UserError(message[1])
    return message[0]


def build(loaded: Loaded, config: DataConfig, runtime: Runtime, seed: int, log, collate_fn: Collate | None = None
          ) -> Data:
    """Chooses the path once, for both splits, and builds the two sources; collate_fn makes the DataLoader path's
    micro-batches (padding dict samples of ids whose lengths differ, or the user's function)."""
    if is_stream(loaded.train) or is_stream(loaded.test):
        return build_stream(loaded, config, runtime, seed, log, collate_fn)
    device_path = _device_path(loaded, config, runtime)
    train, test, val = loaded.train, loaded.test, loaded.val
    collate_fn = learn_kind(collate_fn or Collate(config.pad_id), config, runtime,
                            lambda: [row for split in (train, test, val) for row in probe(split)])
    if collate_fn.padded:  # a stacked split of ids gets the mask that padded micro-batches have
        train, test, val = (with_mask(split) if isinstance(split, Split) else split for split in (train, test, val))
    if device_path:
        train, test = materialize(train, config, collate_fn), materialize(test, config, collate_fn)
        val = None if val is None else materialize(val, config, collate_fn)
    first = first_batch(train, collate_fn)
    _same_kind(loaded.name, first, first_batch(test, collate_fn))
    info = on_rank0(runtime, lambda: _info(loaded, train, test, first, config))
    uint8 = isinstance(first[0], torch.Tensor) and first[0].dtype == torch.uint8
    normalizer = Normalizer(info.mean, info.std, uint8)
    augment = _augment(config, seed, first[0])
    if val is not None:
        _same_kind(loaded.name, first, first_batch(val, collate_fn))
    if device_path:
        sources = tuple(DeviceBatches(split, runtime, normalizer, aug) if split is not None else None
                        for split, aug in ((train, augment), (test, None), (val, None)))
    else:  # each split's samples checked against its first one's kind, so every micro-batch has one structure
        sources = tuple(LoaderBatches(split, runtime, config.num_workers, normalizer, aug, config,
                                      collate_fn.expecting(split)) if split is not None else None
                        for split, aug in ((train, augment), (test, None), (val, None)))
    log(_normalize_line(config, loaded, info, len(train)))
    classes = f"{info.num_classes} classes" if info.num_classes else "no classes"
    log(f"data {info.name}: {len(train)} train / " + (f"{len(val)} validation / " if val is not None else "")
        + f"{len(test)} test samples of {info.inputs} -> {info.targets}, "
        f"{classes}, {'device-resident' if device_path else f'DataLoader ({config.num_workers} workers)'}"
        + (f", augment {config.augment}" if augment else ""))
    return Data(info, *sources)


def build_stream(loaded: Loaded, config: DataConfig, runtime: Runtime, seed: int, log,
                 collate_fn: Collate | None = None) -> Data:
    """A stream for training (distrib.data.stream); its first samples stand in for the split where the data's kind,
    classes and statistics are learnt. A test stream is read whole into memory (evaluation is exact over it)."""
    splits = {"train": loaded.train, "test": loaded.test, "val": loaded.val}
    rows = {name: rows_of(split, f"{name} data", STREAM_HEAD if name == "train" else None)
            for name, split in splits.items() if is_stream(split)}
    collate_fn = learn_kind(collate_fn or Collate(config.pad_id), config, runtime, lambda: [
        *(row for part in rows.values() for row in part), *(row for name, split in splits.items()
                                                           if name not in rows for row in probe(split))])
    made = {name: as_split(rows[name], f"{name} data", collate_fn.expecting(rows[name])) if name in rows
            else None if split is None else materialize(split, config, collate_fn) for name, split in splits.items()}
    sample, test, val = made["train"], made["test"], made["val"]
    if not is_stream(loaded.train):
        return build(Loaded(loaded.name, sample, test, loaded.class_names, loaded.stats, val), config, runtime, seed,
                     log, collate_fn)
    first = first_batch(sample)
    _same_kind(loaded.name, first, first_batch(test))
    info = on_rank0(runtime, lambda: _info(loaded, sample, test, first, config))
    uint8 = isinstance(first[0], torch.Tensor) and first[0].dtype == torch.uint8
    normalizer = Normalizer(info.mean, info.std, uint8)
    augment = _augment(config, seed, first[0])
    source = StreamBatches(loaded.train, runtime, config, Finish(normalizer, augment), log,
                           collate_fn.expecting(rows["train"]))
    log(_normalize_line(config, loaded, info, len(sample)))
    how = "sharded" if is_sharded(loaded.train) else "plain"  # how the ranks read it: said at the first pass
    log(f"data {info.name}: a {how} train stream / {len(test)} test samples of {info.inputs} -> {info.targets}, "
        f"{info.num_classes or 'no'} classes, DataLoader ({config.num_workers} workers)")
    return Data(info, source, DeviceBatches(test, runtime, normalizer),
                None if val is None else DeviceBatches(val, runtime, normalizer))


# ---------------------------------------------------------------- the samples' kind: padded or not


def learn_kind(collate_fn: Collate, config: DataConfig, runtime: Runtime, rows) -> Collate:
    """collate_fn with the data's kind: padded when data.pad = always or when dict samples' ids differ in length
    among `rows()` (a stream's first samples, samples spread over each dataset), learnt on rank 0 for every rank."""
    if collate_fn.user is not None:
        return collate_fn  # the user's function makes the batches
    padded = on_rank0(runtime, lambda: collate_fn.learnt(rows(), config.pad).padded)
    return replace(collate_fn, padded=padded)


def _normalize_line(config: DataConfig, loaded: Loaded, info: DataInfo, num_train: int) -> str:
    """Which normalisation data.normalize chose: the one line that says whether the inputs were rescaled."""
    where = f"data.normalize = {config.normalize if isinstance(config.normalize, str) else 'given'}"
    if not info.mean:
        return f"{where}: inputs {info.inputs} are not images, so they pass as given"
    if config.normalize == "auto" and loaded.stats is None:
        return (f"{where}: per-channel mean {_rounded(info.mean)}, std {_rounded(info.std)} from "
                f"{len(stats_indices(num_train))} training samples (recorded in summary.json)")
    return f"{where}: images normalised with mean {_rounded(info.mean)}, std {_rounded(info.std)}"


def _rounded(values: tuple[float, ...]) -> list[float]:
    return [round(v, 4) for v in values]


def _device_path(loaded: Loaded, config: DataConfig, runtime: Runtime) -> bool:
    if config.loader != "auto":
        return config.loader == "device"
    if not (isinstance(loaded.train, Split) and isinstance(loaded.test, Split)):
        return False  # file-backed: read by DataLoader workers
    return loaded.train.nbytes() + loaded.test.nbytes() < runtime.free_memory_bytes() // 2


def materialize(split: Split | Dataset, config: DataConfig, collate_fn: Collate | None = None) -> Split:
    """A Dataset read whole into tensors (through a DataLoader with data.num_workers), for the device path: padded
    to its longest where the data's kind is (collate_fn.padded), each sample checked against the first one's kind."""
    own = replace(collate_fn, user=None) if collate_fn is not None else Collate(config.pad_id)
    if isinstance(split, Split):
        return with_mask(split) if own.padded else split
    own = own.expecting(split)
    loader = DataLoader(split, batch_size=256, collate_fn=list if own.padded else own,
                        num_workers=config.num_workers, worker_init_fn=init_worker)
    if own.padded:  # one micro-batch of every sample: padded to the split's longest
        batch = _checked(own([row for rows in loader for row in rows]))
        return Split(*batch)
    inputs, targets = [], []
    for batch in loader:
        batch = _checked(batch)
        inputs.append(batch[0])
        targets.append(batch[1])
    kinds = sorted({samples.kind(x) for x in inputs})
    if len(kinds) > 1:
        raise UserError(f"data: samples of different shapes or types ({'; '.join(kinds[:3])}); fix: give samples "
                        "of one shape (pad or cut sequences to one length)")
    return Split(samples.cat(inputs), None if targets[0] is None else samples.cat(targets))


def first_batch(split: Split | Dataset, collate_fn=collate):
    """The first sample as a batch of one (inputs, targets), targets resolved: what the data's kind is read from."""
    if isinstance(split, Split):
        return samples.resolve(*split.rows(torch.arange(1)))
    return samples.resolve(*_checked(collate_fn([split[0]])))


def _same_kind(name: str, train, test) -> None:
    for part, what in ((0, "inputs"), (1, "targets")):
        if part == 1 and isinstance(train[0], dict):
            continue  # a dict sample's labels are inside it: compared with the inputs
        kinds = [_described(batch[part]) for batch in (train, test)]
        if kinds[0] != kinds[1]:
            raise UserError(f"data {name}: train {what} are {kinds[0]}, test {what} {kinds[1]}; fix: give both "
                            f"splits {what} of one shape and type")


def _described(tree) -> str:
    """'[3, 8, 8] float' for float and uint8 tensors, as the seed said it; 'int64 [64]' and dicts otherwise."""
    if isinstance(tree, torch.Tensor) and (tree.is_floating_point() or tree.dtype == torch.uint8):
        return f"{list(tree.shape[1:])} {'uint8' if tree.dtype == torch.uint8 else 'float'}"
    if isinstance(tree, dict):  # token samples may differ in length (they are padded): keys, types and ranks agree
        return "{" + ", ".join(f"{key}: {str(value.dtype).removeprefix('torch.')} of {value.dim() - 1} dims"
                               for key, value in tree.items()) + "}"
    return samples.kind(tree)


def _augment(config: DataConfig, seed: int, inputs) -> Augment | None:
    if config.augment == "none":
        return None
    if not samples.is_image(inputs, per_sample=False):
        raise UserError(f"data.augment = {config.augment!r}: needs image inputs (C, H, W), these are "
                        f"{samples.kind(inputs)}; fix: --set data.augment=none")
    return Augment(config.augment, seed, config.crop_padding)


# ---------------------------------------------------------------- what the data is: classes and normalisation


def _info(loaded: Loaded, train, test, first, config: DataConfig) -> DataInfo:
    inputs, targets = first
    classes = _is_class(targets)
    num_classes, names = _classes(loaded, train, test, config, targets.dim() > 1) if classes else (0, ())
    mean, std = _stats(loaded, train, inputs, config)
    shape = tuple(inputs.shape[1:]) if isinstance(inputs, torch.Tensor) else ()
    return DataInfo(loaded.name, shape, num_classes, names, mean, std, samples.kind(inputs), samples.kind(targets))


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


def _classes(loaded: Loaded, train, test, config: DataConfig, dense: bool) -> tuple[int, tuple[str, ...]]:
    names = loaded.class_names or getattr(loaded.train, "classes", None)
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


def _stats(loaded: Loaded, train, inputs, config: DataConfig) -> Stats:
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
    if loaded.stats is not None:
        mean, std = loaded.stats
        return (tuple(mean) * channels, tuple(std) * channels) if len(mean) == 1 else (mean, std)
    indices = stats_indices(len(train))
    if isinstance(train, Split):
        return channel_stats(train.inputs.index_select(0, chunk) for chunk in indices.split(1024))
    loader = DataLoader(torch.utils.data.Subset(train, indices.tolist()), batch_size=256, collate_fn=collate,
                        num_workers=config.num_workers, worker_init_fn=init_worker)
    return channel_stats(_checked(batch)[0] for batch in loader)


def _checked(batch):
    if isinstance(batch, Failed):
        raise UserError(batch.message)
    return batch
