"""Token shards: `data.train_files` and `data.test_files`, globs of nanoGPT's raw uint16 files or of llm.c's shards (a
header of 256 int32: magic 20240520, version 1, token count; then uint16 ids), each split read as one stream.

The shards of a split, in sorted path order, are concatenated into one stream, so windows are defined exactly as for
one train.bin (distrib.data.text) and may span two shards (llm.c and modded-nanogpt start every document, so every
shard, with an end-of-text token). Each process opens the files on first read: a fork or a pickled copy (a DataLoader
worker) opens its own instead of sharing a handle. Windows are read with os.preadv, not from memory maps: a file cut
short under a live run is then one line, not a SIGBUS."""

from __future__ import annotations

import glob
import io
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
    """The shards of one split as one stream of token ids: reads the ids at any positions (an array of any shape,
    each row read as one span) as int64, through os.preadv on files opened on first use in each process. A file cut
    short under the run is one line naming it, where a memory map's read would kill the process with SIGBUS; an id
    at or over vocab_size (when given) is one line naming its file."""

    def __init__(self, shards: list[Shard], key: str = "data.train_files", vocab_size: int = 0):
        self.shards, self.key, self.vocab_size = shards, key, vocab_size
        self.counts = np.array([shard.num_tokens for shard in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.num_tokens = int(self.counts.sum())
        self._files: list[io.FileIO] | None = None
        self._pid = -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": None, "_pid": -1}  # a copy in another process opens the files itself

    def _opened(self) -> list[int]:
        """This process's file descriptors: a pickled copy (a spawned DataLoader worker) has none, a fork opens its
        own too."""
        if self._pid != os.getpid():
            self._files = [open(shard.path, "rb", buffering=0) for shard in self.shards]  # held open for the run
            self._pid = os.getpid()
        return [file.fileno() for file in self._files]

    def __call__(self, positions: np.ndarray) -> torch.Tensor:
        rows = positions.reshape(-1, positions.shape[-1] if positions.ndim > 1 else 1)
        lows, highs = rows.min(axis=1), rows.max(axis=1) + 1
        shards = np.searchsorted(self.starts, lows, side="right") - 1
        # A window inside one shard is one read straight into its row; any other row is gathered from its span.
        direct = (highs <= self.starts[shards] + self.counts[shards]) & (np.diff(rows, axis=1) == 1).all(axis=1)
        files, starts = self._opened(), self.starts.tolist()
        tokens = np.empty(rows.shape, dtype="<u2")
        for out, row, low, high, shard, one_read in zip(tokens, rows, lows.tolist(), highs.tolist(), shards.tolist(),
                                                        direct.tolist()):
            if one_read:
                self._read(files, shard, low - starts[shard], high - starts[shard], out)
            else:
                out[:] = self._span(files, low, high, shard)[row - low]
        ids = tokens.astype(np.int64)
        if self.vocab_size and ids.size and int(ids.max()) >= self.vocab_size:  # on the host: no device sync
            self._out_of_vocabulary(ids, rows)
        return torch.from_numpy(ids.reshape(positions.shape))

    def _span(self, files: list[int], low: int, high: int, index: int) -> np.ndarray:
        """The uint16 ids at stream positions [low, high), read from the shards they lie in, from shard `index` on."""
        parts = []
        while low < high:
            start = int(self.starts[index])
            end = min(high - start, self.shards[index].num_tokens)
            parts.append(self._read(files, index, low - start, end))
            low, index = start + end, index + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _read(self, files: list[int], index: int, first: int, end: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [first, end) of shard `index`, into `out` if given; a short read (the file shrank since it was
        opened) is one line."""
        shard, want = self.shards[index], 2 * (end - first)
        out = np.empty(end - first, dtype="<u2") if out is None else out
        if os.preadv(files[index], [out], shard.offset + 2 * first) < want:
            size = os.fstat(files[index]).st_size
            raise UserError(f"{self.key}: {shard.path} was cut short under the run: it holds {size} bytes, "
                            f"{shard.offset + 2 * shard.num_tokens} when the run opened it; fix: restore the file "
                            "and run the same command again (it resumes from the last checkpoint)")
        return out

    def _out_of_vocabulary(self, ids: np.ndarray, rows: np.ndarray) -> None:
        where = np.unravel_index(int(ids.argmax()), ids.shape)
        largest, position = int(ids[where]), int(rows[where])
        index = int(np.searchsorted(self.starts, position, side="right")) - 1
        raise UserError(f"data.vocab_size = {self.vocab_size}: {self.shards[index].path} holds token id {largest} "
                        f"(its token {position - int(self.starts[index])}); fix: --set data.vocab_size={largest + 1} "
                        "or more (the tokenizer's vocabulary)")


def token_streams(train_files: str, test_files: str, vocab_size: int = 0) -> tuple[TokenStream, TokenStream]:
    """(train, test) streams of data.train_files and data.test_files; a file in both is refused."""
    train = find_shards("data.train_files", train_files)
    test = find_shards("data.test_files", test_files)
    both = sorted({s.path.resolve() for s in train} & {s.path.resolve() for s in test})
    if both:
        raise UserError(f"data.test_files = {test_files!r}: {both[0]} is also a training file (data.train_files = "
                        f"{train_files!r}); fix: give globs that do not overlap, so the test tokens stay held out")
    return TokenStream(train, "data.train_files", vocab_size), TokenStream(test, "data.test_files", vocab_size)
