"""Token shards: `data.train_files` and `data.test_files`, globs of nanoGPT's raw uint16 files or of llm.c's shards (a
header of 256 int32: magic 20240520, version 1, token count; then uint16 ids), each split read as one stream.

The shards of a split, in sorted path order, are concatenated into one stream, so windows are defined exactly as for
one train.bin (distrib.data.text) and may span two shards (llm.c and modded-nanogpt start every document, so every
shard, with an end-of-text token). Each process opens its memory maps on first read: a fork or a pickled copy (a
DataLoader worker) opens its own instead of sharing a handle."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from distrib.errors import UserError

LLMC_MAGIC = 20240520  # llm.c's dev/data/data_common.py write_datafile
LLMC_VERSION = 1  # uint16 tokens (GPT-2's tokenizer)
HEADER_BYTES = 256 * 4


@dataclass(frozen=True)
class Shard:
    path: Path
    offset: int  # bytes before the first token: 0 for a raw file, HEADER_BYTES for llm.c's
    num_tokens: int


def _header(path: Path) -> tuple[int, int, int] | None:
    """(magic, version, token count) when the file starts with llm.c's magic, else None (a raw file)."""
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(12).ljust(12, b"\0"), dtype="<i4")
    return (int(head[0]), int(head[1]), int(head[2])) if head[0] == LLMC_MAGIC else None


def read_shard(key: str, path: Path) -> Shard:
    """The shard's layout, checked against its size: a truncated or foreign file is one line naming it."""
    size = path.stat().st_size
    header = _header(path) if size >= 4 else None
    if header is None:
        if size == 0 or size % 2:
            raise UserError(f"{key}: {path} has {size} bytes, so it is neither uint16 token ids (an even number of "
                            f"bytes) nor an llm.c shard (magic {LLMC_MAGIC} first); fix: leave it out of the glob, "
                            "or write it with np.array(ids, dtype=np.uint16).tofile(path)")
        return Shard(path, 0, size // 2)
    _, version, count = header
    if version != LLMC_VERSION:
        raise UserError(f"{key}: {path} is an llm.c shard of version {version}; only version {LLMC_VERSION} (uint16 "
                        "token ids) is read; fix: write it with llm.c's GPT-2 data scripts, or leave it out")
    body = size - HEADER_BYTES
    if body < 2 * count:
        raise UserError(f"{key}: {path} is truncated: its header says {count} tokens, the file holds "
                        f"{max(body, 0) // 2}; fix: copy or write it again")
    if body != 2 * count:
        raise UserError(f"{key}: {path} has {body} bytes after its header, which says {count} tokens "
                        f"({2 * count} bytes); fix: write it again, or leave it out of the glob")
    return Shard(path, HEADER_BYTES, count)


def find_shards(key: str, pattern: str) -> list[Shard]:
    """The files the glob names, sorted; all raw or all llm.c shards (a file of the other kind is foreign)."""
    paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())
    if not paths:
        raise UserError(f"{key} = {pattern!r}: matches no file; fix: give a glob of token files, e.g. "
                        "--set 'data.train_files=data/fineweb10B/fineweb_train_*.bin'")
    shards = [read_shard(key, path) for path in paths]
    kinds = {shard.offset for shard in shards}
    if len(kinds) > 1:
        first = next(s for s in shards if s.offset)
        raw = next(s for s in shards if not s.offset)
        raise UserError(f"{key}: {raw.path} has no llm.c header (magic {LLMC_MAGIC}) though {first.path} has one; "
                        "fix: give files of one format, or leave the foreign one out of the glob")
    return shards


class TokenStream:
    """The shards of one split as one stream of token ids: reads the ids at any positions (an array of any shape) as
    int64, each from its shard's memory map, opened on first use in each process."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards
        counts = np.array([shard.num_tokens for shard in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.num_tokens = int(counts.sum())
        self._maps: list[np.memmap] | None = None
        self._pid = -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None, "_pid": -1}  # a copy in another process maps the files itself

    def _opened(self) -> list[np.memmap]:
        if self._pid != os.getpid():  # also after a fork: never a handle shared with the parent
            self._maps = [np.memmap(s.path, dtype=np.uint16, mode="r", offset=s.offset, shape=(s.num_tokens,))
                          for s in self.shards]
            self._pid = os.getpid()
        return self._maps

    def __call__(self, positions: np.ndarray) -> torch.Tensor:
        maps = self._opened()
        which = np.searchsorted(self.starts, positions, side="right") - 1
        ids = np.empty(positions.shape, dtype=np.int64)
        for shard in np.unique(which):
            here = which == shard
            ids[here] = maps[shard][positions[here] - self.starts[shard]]  # only these pages are read
        return torch.from_numpy(ids)


def token_streams(train_files: str, test_files: str) -> tuple[TokenStream, TokenStream]:
    """(train, test) streams of data.train_files and data.test_files; a file in both is refused."""
    train = find_shards("data.train_files", train_files)
    test = find_shards("data.test_files", test_files)
    both = sorted({s.path.resolve() for s in train} & {s.path.resolve() for s in test})
    if both:
        raise UserError(f"data.test_files = {test_files!r}: {both[0]} is also a training file (data.train_files = "
                        f"{train_files!r}); fix: give globs that do not overlap, so the test tokens stay held out")
    return TokenStream(train), TokenStream(test)
