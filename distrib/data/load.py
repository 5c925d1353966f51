"""load_data: the one entry point from a DataConfig to Data (info and two batch sources), for named sets, a
data.factory, or datasets handed to distrib.fit(). Every data mistake is one UserError, raised on every rank."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from distrib.config import DataConfig
from distrib.data import documents, identity, idx, named
from distrib.data.assemble import Data, Loaded, build, distributed, on_rank0
from distrib.data.collate import collate_for
from distrib.data.factory import as_split_or_dataset, call_data_factory
from distrib.data.materialize import materialize
from distrib.data.tensors import FASHION_MNIST_STATS, Split
from distrib.data.text import token_data
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError, say

KNOWN_STATS = {"fashion-mnist": FASHION_MNIST_STATS, "mnist": idx.SETS["mnist"].stats, "cifar10": named.CIFAR_STATS,
               "synthetic": FASHION_MNIST_STATS}  # synthetic keeps the values it was always normalised with


def load_data(config: DataConfig, runtime: Runtime, seed: int, log: Callable[[str], None] | None = None) -> Data:
    """Named sets and data.factory. Rank 0 alone unpacks or downloads while the others wait in a collective; then
    every rank reads the files. Nothing is written to run.dir here."""
    log = log or _main_log(runtime)
    if config.name in ("text", "tokens") and not config.factory:
        return _token_data(config, runtime, seed, log)
    on_rank0(runtime, lambda: _prepare(config, log))
    loaded = _on_every_rank(runtime, lambda: _read(config))
    _columns_note(loaded, log)
    data = build(loaded, config, runtime, seed, log, collate_for(config.pad_id, config.collate))
    return dataclasses.replace(data, identity=_identity(config, loaded))


def data_from_datasets(train, test, config: DataConfig, runtime: Runtime, seed: int,
                       log: Callable[[str], None] | None = None, collate_fn: Callable | None = None,
                       val=None) -> Data:
    """For distrib.fit(): map-style Datasets of (tensor, int label), or (inputs, labels) tensor pairs; collate_fn
    (the user's, for the DataLoader path) wins over data.collate; val: a validation set, of the same kinds."""
    log = log or _main_log(runtime)
    loaded = _on_every_rank(runtime, lambda: Loaded(
        "custom", as_split_or_dataset(train, "train data"), as_split_or_dataset(test, "test data"),
        val=None if val is None else as_split_or_dataset(val, "fit(val_data=...)")))
    _columns_note(loaded, log)
    data = build(loaded, config, runtime, seed, log, collate_for(config.pad_id, config.collate, collate_fn))
    return dataclasses.replace(data, identity=identity.of_objects(train=loaded.train, test=loaded.test, val=loaded.val))


def _columns_note(loaded: Loaded, log) -> None:
    """Which columns of a Hugging Face dataset are the targets and which were dropped: said once, for train."""
    note = getattr(loaded.train, "note", None)
    if isinstance(note, str):
        log(note)


def _token_data(config: DataConfig, runtime: Runtime, seed: int, log) -> Data:
    """Language-model data (distrib.data.text): every rank opens the files; windows are read as batches need them."""
    info, train, test = _on_every_rank(runtime, lambda: token_data(config, runtime, seed))
    log(f"data {info.name}: {train.num_tokens} train / {test.num_tokens} test tokens, vocabulary {info.num_classes}, "
        f"{train.num_samples} windows of {config.seq_len} per epoch, {test.num_samples} test windows"
        + (" (device-resident)" if config.name == "text" else " (read window by window)")
        + (f", {len(train.read.shards)} train / {len(test.read.shards)} test shards" if config.train_files else "")
        + (f", {documents.words(config.eos_id)}" if config.document_mask else ""))
    return Data(info, train, test, identity=identity.of_files([*train.paths, *test.paths]))


def _identity(config: DataConfig, loaded: Loaded) -> Callable[[], dict]:
    """What identifies the data in a checkpoint: the files of a named set, or what the objects read can say."""
    if not config.factory and config.name in idx.SETS:
        raw = idx.SETS[config.name].raw(Path(config.root))
        return identity.of_files(raw / name for name in idx.RAW_FILES)
    if not config.factory and config.name == "cifar10":
        folder = named.cifar_folder(Path(config.root))
        return identity.of_files(folder / name for name in named.CIFAR_FILES)
    return identity.of_objects(train=loaded.train, test=loaded.test, val=loaded.val)


def _main_log(runtime: Runtime) -> Callable[[str], None]:
    return lambda message: say(f"[distrib] {message}") if runtime.is_main else None  # as Recorder.info


def _on_every_rank(runtime: Runtime, fn):
    """Runs fn on every rank; if it raised a UserError on any rank, every rank raises it (no rank hangs)."""
    try:
        result, error = fn(), None
    except UserError as e:
        result, error = None, str(e)
    if distributed(runtime):
        errors = [None] * runtime.world_size
        dist.all_gather_object(errors, error)
        error = error or next((e for e in errors if e), None)
    if error:
        raise UserError(error)
    return result


# ---------------------------------------------------------------- reading the named sets and factories


def _check_root(config: DataConfig) -> Path:
    root = Path(config.root)
    if root.exists() and not root.is_dir():
        raise UserError(f"data.root = {config.root!r}: is a file, not a folder; fix: give the folder that holds "
                        f"the dataset (or where it may be unpacked), e.g. --set data.root={root.parent / 'data'}")
    return root


def _foreign(config: DataConfig, root: Path, title: str) -> None:
    """Refuses a data.root that visibly holds another dataset than the one named."""
    found = named.what_is_in(root)
    if found and config.name not in found[1]:
        raise UserError(f"data.root = {config.root!r}: holds {found[0]}, not {title}; fix: --set "
                        f"data.name={found[1][0]} to train on it, or point data.root at {title}")


def _prepare(config: DataConfig, log) -> None:
    """Rank 0's part: checks data.root and makes the named set's files ready (unpacked, or downloaded)."""
    if config.factory or config.name == "synthetic":
        return
    root = _check_root(config)
    if config.name in idx.SETS:
        spec = idx.SETS[config.name]
        if idx.cache_problems(spec.raw(root)) and not idx.find_sources(root):
            _foreign(config, root, spec.title)
        idx.prepare(config.name, root, log, idx.download)
    elif config.name == "cifar10":
        if not named.cifar_found(root):
            _foreign(config, root, "CIFAR-10")
            _download_cifar(root, log)
    elif not (root / "train").is_dir():
        _foreign(config, root, "an ImageFolder tree")


def _read(config: DataConfig) -> Loaded:
    """Every rank's part, after _prepare: reads both splits (no collectives, so a failure cannot hang a rank)."""
    if config.factory:
        *train_val, test = call_data_factory(config.factory, config.kwargs)
        where = f"data.factory = {config.factory!r}"
        val = as_split_or_dataset(train_val[1], f"{where}: val") if len(train_val) == 2 else None
        return Loaded(config.factory, as_split_or_dataset(train_val[0], f"{where}: train"),
                      as_split_or_dataset(test, f"{where}: test"), val=val)
    if config.name == "synthetic":
        shape, classes = tuple(config.synthetic_shape), config.num_classes or 10
        return Loaded("synthetic", named.synthetic_split(config.synthetic_train_size, 1, shape, classes),
                      named.synthetic_split(config.synthetic_test_size, 2, shape, classes),
                      tuple(str(i) for i in range(classes)), KNOWN_STATS["synthetic"])
    root = Path(config.root)
    if config.name in idx.SETS:
        train, test, classes = idx.load(config.name, root)
    elif config.name == "cifar10":
        train, test, classes = named.load_cifar10(root)
    else:
        train, test = named.imagefolder_splits(root, config.image_size)
        classes = train.classes
    return Loaded(config.name, train, test, classes, KNOWN_STATS.get(config.name))


def _download_cifar(root: Path, log) -> None:
    try:
        log(f"downloading CIFAR-10 into {root / 'cifar-10-batches-py'}")
        named.download_cifar10(root)
    except Exception as e:  # noqa: BLE001 - any failure becomes the one clear message below
        raise UserError(f"data.root = {str(root)!r}: CIFAR-10 not found (looked for {', '.join(named.CIFAR_FILES)} "
                        f"in {root} and {root / 'cifar-10-batches-py'}) and the download failed ({type(e).__name__});"
                        " fix: unpack cifar-10-python.tar.gz into data.root, or use --set data.name=synthetic") \
            from None


def load_splits(config: DataConfig, runtime: Runtime | None) -> tuple[Split, Split]:
    """Both splits as tensors in host memory (the scripts' and older tests' entry; the worker uses load_data)."""
    on_rank0(runtime, lambda: _prepare(config, lambda message: None))
    loaded = _read(config)
    return materialize(loaded.train, config), materialize(loaded.test, config)
