"""From splits as read to Data: the loader path chosen once for both splits, input shape, classes and
normalisation probed once (rank 0) and the same on every rank, and the two batch sources built."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from distrib.config import DataConfig
from distrib.data import samples
from distrib.data.augment import Augment
from distrib.data.batching import BatchSource, DeviceBatches, Finish, LoaderBatches
from distrib.data.collate import Collate, probe, with_mask
from distrib.data.describe import Stats, describe
from distrib.data.materialize import first_batch, materialize, same_kind
from distrib.data.stream import StreamBatches, is_sharded, is_stream
from distrib.data.stream_read import as_split, rows_of
from distrib.data.tensors import DataInfo, Normalizer, Split, stats_indices
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError

STREAM_HEAD = 256  # a stream's first samples: where its kind, classes and image statistics are learnt


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
    same_kind(loaded.name, first, first_batch(test, collate_fn))
    info = on_rank0(runtime, lambda: _describe(loaded, train, test, first, config))
    uint8 = isinstance(first[0], torch.Tensor) and first[0].dtype == torch.uint8
    normalizer = Normalizer(info.mean, info.std, uint8)
    augment = _augment(config, seed, first[0])
    if val is not None:
        same_kind(loaded.name, first, first_batch(val, collate_fn))
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
    same_kind(loaded.name, first, first_batch(test))
    info = on_rank0(runtime, lambda: _describe(loaded, sample, test, first, config))
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


def learn_kind(collate_fn: Collate, config: DataConfig, runtime: Runtime, rows) -> Collate:
    """collate_fn with the data's kind: padded when data.pad = always or when dict samples' ids differ in length
    among `rows()` (a stream's first samples, samples spread over each dataset), learnt on rank 0 for every rank."""
    if collate_fn.user is not None:
        return collate_fn  # the user's function makes the batches
    padded = on_rank0(runtime, lambda: collate_fn.learnt(rows(), config.pad).padded)
    return replace(collate_fn, padded=padded)


def _describe(loaded: Loaded, train, test, first, config: DataConfig) -> DataInfo:
    """What the data is: the class names and statistics it came with (a dataset's `classes` too), else learnt."""
    names = loaded.class_names or getattr(loaded.train, "classes", None)
    return describe(loaded.name, train, test, first, config, names, loaded.stats)


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

def _augment(config: DataConfig, seed: int, inputs) -> Augment | None:
    if config.augment == "none":
        return None
    if not samples.is_image(inputs, per_sample=False):
        raise UserError(f"data.augment = {config.augment!r}: needs image inputs (C, H, W), these are "
                        f"{samples.kind(inputs)}; fix: --set data.augment=none")
    return Augment(config.augment, seed, config.crop_padding)

