"""Reading a stream inside one DataLoader worker (or in the training process when data.num_workers = 0): which
micro-batches the worker yields, in order, each with the worker's position after it, so a checkpoint can restart
every worker exactly where the training consumed its last micro-batch.

Plain streams (an IterableDataset that knows nothing of ranks or workers): every worker of every rank iterates the
whole stream; global batch k is stream samples [kG, (k+1)G), this rank keeps its slice, and worker w of W keeps the
micro-batches j with j % W == w. A global batch the stream ends inside is never yielded: every rank stops alike.
Sharded streams (a source that knows its shards): this rank's part is read by its workers, each its own shards (a
Hugging Face IterableDataset splits them among the workers itself); each worker cuts its samples into micro-batches."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from distrib.data.batching import Failed, collate
from distrib.data.tensors import Split
from distrib.errors import UserError


@dataclass(frozen=True)
class Layout:
    """Who reads what: this rank's share of the global batch, and the worker count (1 when read in-process)."""

    sharded: bool
    rank: int
    world_size: int
    global_batch_size: int
    grad_accum_steps: int
    num_workers: int  # logical readers: data.num_workers, or 1

    @property
    def per_rank(self) -> int:
        return self.global_batch_size // self.world_size

    @property
    def micro_batch_size(self) -> int:
        return self.per_rank // self.grad_accum_steps


@dataclass
class Item:
    """What a worker yields: a micro-batch (samples collated, or a Failed), or its end (`batch` None, `count` the
    samples it read but did not yield: a partial micro-batch or global batch)."""

    worker: int
    batch: Any = None
    count: int = 0  # samples in the micro-batch, or left at the end
    state: Any = None  # the worker's position after this item: a source state_dict, or samples read
    first: int = 0  # plain streams: the stream position of the micro-batch's first sample (augmentation's key)
    read: int = 0  # at the end: samples the worker read in this pass (plain streams: the stream's length)
    origin: str = ""  # plain streams: a fingerprint of the first sample of the stream as this worker iterates it


def identity(item):
    return item


def worker_id() -> int:
    info = get_worker_info()
    return info.id if info is not None else 0


class WorkerStream(IterableDataset):
    """The DataLoader's dataset: in each worker, that worker's micro-batches of this rank, in order, then its end.
    `start` restarts a pass: {"samples": n} for plain streams (every worker skips the first n samples, which are whole
    global batches), or per worker {"state": ...} (the source's own state_dict) or {"read": n} (samples to skip)."""

    def __init__(self, source, layout: Layout, collate, start: dict | None = None):
        self.source, self.layout, self.collate, self.start = source, layout, collate, start or {}

    def __iter__(self) -> Iterator[Item]:
        return self.read(worker_id())

    def read(self, worker: int) -> Iterator[Item]:
        """Worker `worker`'s items (the DataLoader calls it through __iter__ in that worker)."""
        if self.layout.sharded:
            return self._sharded(worker)
        return self._plain(worker)

    def _plain(self, worker: int) -> Iterator[Item]:
        layout, skip = self.layout, self.start.get("samples", 0)
        stream, size = guarded(self.source), layout.global_batch_size
        opening = list(islice(stream, 1))  # every worker must see the same first sample (distrib.data.stream checks)
        origin, stream = fingerprint(opening), chain(opening, stream)
        read = sum(1 for _ in islice(stream, skip))
        if read < skip:
            yield Item(worker, count=0, read=read, origin=origin)
            return
        step = skip // size
        while True:
            chunk = list(islice(stream, size))
            read += len(chunk)
            if chunk and isinstance(chunk[-1], Failed):  # the stream raised: this worker's last item says so
                yield Item(worker, chunk[-1], size)
                return
            if len(chunk) < size:
                yield Item(worker, count=len(chunk), read=read, origin=origin)
                return
            for item in self._slices(worker, step, chunk):
                item.origin = origin
                yield item
            step += 1

    def _slices(self, worker: int, step: int, chunk: list) -> Iterator[Item]:
        """This rank's micro-batches of one global batch that are this worker's (micro-batch j goes to j % W). The
        owner of a step's first micro-batch checks the whole global batch, so every rank finds a bad sample at the
        same step, whichever rank's slice holds it."""
        layout, size = self.layout, self.layout.micro_batch_size
        for micro in range(layout.grad_accum_steps):
            index = step * layout.grad_accum_steps + micro
            if index % layout.num_workers != worker:
                continue
            whole = self.collate(chunk) if micro == 0 else None
            if isinstance(whole, Failed):
                yield Item(worker, whole, size)
                return
            lo = layout.rank * layout.per_rank + micro * size
            yield Item(worker, self.collate(chunk[lo:lo + size]), size, first=step * layout.global_batch_size + lo)

    def _sharded(self, worker: int) -> Iterator[Item]:
        source, mine = self.source, self.start.get(worker, {})
        stateful = callable(getattr(source, "state_dict", None)) and callable(getattr(source, "load_state_dict", None))
        if "state" in mine and stateful:
            source.load_state_dict(mine["state"])
        stream, read = guarded(source), mine.get("read", 0)
        if "state" not in mine and read:
            list(islice(stream, read))  # no state of its own: skip what was trained
        size = self.layout.micro_batch_size
        while True:
            chunk = list(islice(stream, size))
            read += len(chunk)
            if chunk and isinstance(chunk[-1], Failed):  # the stream raised: this worker's last item says so
                yield Item(worker, chunk[-1], size)
                return
            if len(chunk) < size:
                yield Item(worker, count=len(chunk), read=read)
                return
            position = {"state": source.state_dict()} if stateful else {"read": read}
            yield Item(worker, self.collate(chunk), size, state={**position, "read": read})


class Shards(IterableDataset):
    """A sharded stream of files: `read(path)` yields one file's samples. Each rank reads files[rank::world_size]
    and each of its DataLoader workers every W-th of those; a resume skips what was trained (it has no state)."""

    def __init__(self, files, read):
        self.files, self.read = [str(f) for f in files], read

    @property
    def n_shards(self) -> int:
        return len(self.files)

    def shard(self, num_shards: int, index: int) -> Shards:
        return Shards(self.files[index::num_shards], self.read)

    def __iter__(self):
        info = get_worker_info()
        files = self.files[info.id::info.num_workers] if info is not None else self.files
        for path in files:
            yield from self.read(path)


def fingerprint(rows: list) -> str:
    """A short hash of samples' contents (tensors' and arrays' bytes, numbers' and strings' values; of other objects
    only their type, whose repr may hold an address), to tell whether two iterations of a stream begin alike."""
    digest = hashlib.blake2b(digest_size=8)

    def feed(value) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype} {value.layout}".encode())
            try:
                value = value.detach().cpu().contiguous()
                digest.update(f"{tuple(value.shape)}".encode() + value.reshape(-1).view(torch.uint8).numpy().tobytes())
            except (RuntimeError, TypeError):  # sparse, nested or quantized: their kind only
                pass
        elif isinstance(value, dict):
            for key, item in value.items():
                digest.update(repr(key).encode())
                feed(item)
        elif isinstance(value, (list, tuple)):
            digest.update(f"{type(value).__name__} {len(value)}".encode())
            for item in value:
                feed(item)
        elif value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
            digest.update(repr(value).encode())
        else:
            digest.update(type(value).__qualname__.encode())
            if callable(getattr(value, "tobytes", None)) and type(value).__module__ == "numpy":
                digest.update(value.tobytes())

    for row in rows:
        feed(row)
    return digest.hexdigest()


def rows_of(stream, what: str, limit: int | None = None) -> list:
    """A stream's samples (its first `limit`), read in this process, as tensors; an empty stream, or one that
    raised, is one line."""
    rows = head(stream, limit) if limit else list(guarded(stream))
    if rows and isinstance(rows[-1], Failed):
        raise UserError(f"{what}: {rows[-1].message.removeprefix('data: ')}")
    if not rows:
        raise UserError(f"{what}: an empty stream (it yielded no sample); fix: give a stream with samples (check "
                        "its files or its filter)")
    return [as_tensors(row) for row in rows]


def as_split(rows: list, what: str, collate_fn: Callable = collate) -> Split:
    """Samples as tensors, collated as training collates them (padded where the data's kind is); a bad sample is one
    line."""
    batch = collate_fn(rows)
    if isinstance(batch, Failed):
        raise UserError(f"{what}: {batch.message.removeprefix('data: ')} (among its first {len(rows)} samples)")
    return Split(*batch)


def head(source, count: int) -> list:
    """The first `count` samples of a stream, read in this process (what the data's kind is learnt from); an error of
    reading it ends the list as a Failed."""
    return list(islice(guarded(source), count))


def guarded(source) -> Iterator:
    """The stream's samples; what its iteration raises (a Hugging Face stream's cast error when a column changes type
    mid-pass, a reader's error) becomes one Failed item at its end, which travels from a DataLoader worker to every
    rank's one line, as a bad sample does."""
    try:
        yield from source
    except Exception as e:  # noqa: BLE001 - the user's stream (or datasets'): one line, not a worker's traceback
        said = " ".join(str(e).split())
        said = said if len(said) <= 240 else f"{said[:140]} ... {said[-90:]}"
        yield Failed(f"data: reading the stream raised {type(e).__name__}: {said}; fix: make every sample of the "
                     "stream alike (a Hugging Face stream's columns keep the names and types of its first file)")


def kinds_of(batch) -> str:
    """A collated micro-batch's structure (keys, dtypes and dimensions, not sizes: a collate function may pad any of
    them), to compare across batches: a stream may change it halfway. distrib's own collate checks each sample's sizes
    too, against the data's kind (distrib.data.collate), where it knows which length is padded."""
    return " -> ".join(_structure(part) for part in batch)


def _structure(tree) -> str:
    if isinstance(tree, torch.Tensor):
        return f"{str(tree.dtype).removeprefix('torch.')} {tree.dim() - 1}-d"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{key}: {_structure(value)}" for key, value in tree.items()) + "}"
    return "none"


class StreamCollate:
    """The DataLoader path's collate (distrib.data.collate: padding, or the user's function), after Hugging Face rows
    of Python numbers are made tensors. Picklable, for the worker processes."""

    def __init__(self, collate_fn: Callable = collate):
        self.collate_fn = collate_fn

    def __call__(self, chunk: list):
        return self.collate_fn([as_tensors(sample) for sample in chunk])


def as_tensors(sample):
    """A Hugging Face row of Python numbers or lists becomes tensors (its own with_format('torch') does the same)."""
    if isinstance(sample, dict) and not all(isinstance(v, torch.Tensor) for v in sample.values()):
        try:
            return {key: torch.as_tensor(value) for key, value in sample.items()}
        except (TypeError, ValueError, RuntimeError):
            return sample
    return sample
