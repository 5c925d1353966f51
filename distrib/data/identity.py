"""What identifies a run's data, cheaply, so that a resume can tell whether it reads the data its checkpoint was
taken on: each file's path, size and a fingerprint of a few blocks (head, tail and strided ones, at most 256 KiB read
whatever its size); data from code (a factory, distrib.fit, a stream) says what it can: its class, its length, and
for tensors in memory a fingerprint of a few rows. A change outside the blocks or rows read goes unnoticed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, Iterable

import torch

from distrib.data import samples
from distrib.data.stream_read import Shards
from distrib.data.tensors import Split

BLOCK_BYTES = 16 * 1024
NUM_BLOCKS = 16  # head, tail and 14 strided blocks: at most 256 KiB read a file, whatever its size
NUM_ROWS = 64  # rows of a tensor split fingerprinted, evenly spaced


def _digest() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=12)


def file_identity(path: Path) -> dict:
    """{"path", "size", "hash"}: the hash of the whole file when it is small, else of NUM_BLOCKS evenly spaced blocks
    from its first byte to its last."""
    digest, size = _digest(), os.stat(path).st_size
    with open(path, "rb") as f:
        if size <= BLOCK_BYTES * NUM_BLOCKS:
            digest.update(f.read())
        else:
            for block in range(NUM_BLOCKS):
                digest.update(os.pread(f.fileno(), BLOCK_BYTES, block * (size - BLOCK_BYTES) // (NUM_BLOCKS - 1)))
    return {"path": str(path), "size": size, "hash": digest.hexdigest()}


def of_files(paths: Iterable[Path]) -> Callable[[], dict]:
    """The identity of data read from files (each once, in the order given), computed when asked: only the rank
    that writes checkpoints reads the blocks, and plan or predict never do."""
    unique = tuple(dict.fromkeys(str(p) for p in paths))
    return lambda: {"files": [file_identity(Path(p)) for p in unique], "objects": {}}


def of_objects(**splits) -> Callable[[], dict]:
    """The identity of data given as objects (None splits left out), described now so that the objects are not
    kept for it; a distrib.data.Shards stream's files are fingerprinted when asked (its shards may name other things
    than files: only those that are files are read)."""
    files = of_files(path for value in splits.values() if isinstance(value, Shards) for path in value.files
                     if os.path.isfile(path))
    objects = {name: describe(value) for name, value in splits.items() if value is not None}
    return lambda: {**files(), "objects": objects}


def describe(value) -> dict:
    """What an object of data can say of itself: its class, its length if it has one, and a fingerprint of what it
    holds where that is cheap (a few rows of tensors, an image folder's file names)."""
    kind = type(value).__qualname__ if type(value).__module__ == "builtins" else \
        f"{type(value).__module__}.{type(value).__qualname__}"
    try:
        length = len(value)
    except (TypeError, NotImplementedError):  # a stream, or a Dataset whose __len__ says it has none
        length = None
    if isinstance(value, Split):
        return {"kind": "tensors", "len": length, "hash": _rows_hash(value), "of": "values"}
    folder = getattr(value, "inner", value)  # a torchvision ImageFolder, or distrib's ImageFiles around one
    names = getattr(folder, "samples", None)  # [(path, class index)]
    if isinstance(names, list) and names and isinstance(names[0], tuple) and isinstance(names[0][0], str):
        root = str(getattr(folder, "root", ""))
        digest = _digest()
        for path, target, *_ in names:  # relative to the folder: a moved folder holds the same names
            path = str(path)
            digest.update(f"{path[len(root):] if root and path.startswith(root) else path}\0{target}\n".encode())
        return {"kind": kind, "len": length, "hash": digest.hexdigest(), "of": "file names"}
    return {"kind": kind, "len": length, "hash": None, "of": ""}


def _rows_hash(split: Split) -> str:
    """The hash of NUM_ROWS evenly spaced rows of every tensor of the split, with their shapes and dtypes."""
    digest = _digest()
    count = len(split)
    num_rows = min(count, NUM_ROWS)
    rows = torch.arange(num_rows) * max(count - 1, 0) // max(num_rows - 1, 1)
    for name, tensor in {**samples.named(split.inputs, "inputs"), **samples.named(split.targets, "targets")}.items():
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        picked = tensor[rows].detach().to("cpu").contiguous().reshape(-1)
        digest.update(picked.view(torch.uint8).numpy().tobytes() if picked.numel() else b"")
    return digest.hexdigest()


def data_changes(saved: dict, current: dict) -> list[str]:
    """How the data differs from the checkpoint's, one phrase each (empty when the same): each file gone, new, of
    another size or content; each split of another kind, length or fingerprint."""
    changes = _file_changes(saved.get("files", []), current.get("files", []))
    old, new = saved.get("objects", {}), current.get("objects", {})
    for split in sorted(set(old) | set(new)):
        if old.get(split) != new.get(split):
            changes.append(_object_change(split, old.get(split), new.get(split)))
    return changes


def _file_changes(old: list[dict], new: list[dict]) -> list[str]:
    """Files matched by path, then those left by name (a folder moved or copied elsewhere), named as they are now."""
    if [(f["size"], f["hash"]) for f in old] == [(f["size"], f["hash"]) for f in new]:
        return []  # the same bytes in the same order, wherever the files now are
    left = {f["path"]: f for f in new}
    pairs = [[before, left.pop(before["path"], None)] for before in old]
    for pair in pairs:
        named = [path for path in left if Path(path).name == Path(pair[0]["path"]).name] if pair[1] is None else []
        if len(named) == 1:  # the one file of that name elsewhere: moved
            pair[1] = left.pop(named[0])
    changes = []
    for before, after in pairs:
        if after is None:
            changes.append(f"{before['path']} is gone")
        elif after["size"] != before["size"]:
            changes.append(f"{after['path']}: {before['size']} -> {after['size']} bytes")
        elif after["hash"] != before["hash"]:
            changes.append(f"{after['path']}: other content (the same {after['size']} bytes)")
    changes += [f"{path} is new" for path in left]
    return changes or ["the files' order changed"]


def _object_change(split: str, old: dict | None, new: dict | None) -> str:
    if old is None or new is None:
        return f"the {split} data: {'none' if old is None else old['kind']} -> {'none' if new is None else new['kind']}"
    if old["kind"] != new["kind"]:
        return f"the {split} data: a {old['kind']} -> a {new['kind']}"
    if old["len"] != new["len"]:
        return f"the {split} data ({new['kind']}): {old['len']} -> {new['len']} samples"
    return f"the {split} data ({new['kind']}): other {new['of'] or 'fingerprint'} in the same {new['len']} samples"
