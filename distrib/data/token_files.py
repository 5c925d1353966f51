"""Token shards: `data.train_files` and `data.test_files`, globs of raw files of token ids (nanoGPT's uint16, or
uint32 as data.token_dtype declares) or of llm.c's shards (a header of 256 int32: magic, version, token count; then
the ids: GPT-2's magic 20240520 version 1 of uint16, Llama 3's 20240801 version 7 of uint32), each split one stream.

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

# llm.c's dev/data/data_common.py write_datafile: (magic, version) -> the ids' type. GPT-2's shards, then Llama 3's.
LLMC_MAGIC, LLMC_VERSION = 20240520, 1  # GPT-2's shards (uint16 ids)
LLMC_FORMATS = {(LLMC_MAGIC, LLMC_VERSION): "uint16", (20240801, 7): "uint32"}
LLMC_MAGICS = {magic for magic, _ in LLMC_FORMATS}
LLMC_NAMES = "magic 20240520 version 1 (GPT-2's, uint16 ids) or magic 20240801 version 7 (Llama 3's, uint32 ids)"
TOKEN_DTYPES = {"uint16": "<u2", "uint32": "<u4"}  # data.token_dtype -> the little-endian numpy type on disk
HEADER_BYTES = 256 * 4


@dataclass(frozen=True)
class Shard:
    path: Path
    offset: int  # bytes before the first token: 0 for a raw file, HEADER_BYTES for llm.c's
    num_tokens: int
    dtype: str = "uint16"  # the ids' type: llm.c's header says it, data.token_dtype declares a raw file's

    @property
    def itemsize(self) -> int:
        return np.dtype(TOKEN_DTYPES[self.dtype]).itemsize


def _header(path: Path) -> tuple[int, int, int] | None:
    """(magic, version, token count) when the file starts with one of llm.c's magics, else None (a raw file)."""
    with open(path, "rb") as f:
        head = np.frombuffer(f.read(12).ljust(12, b"\0"), dtype="<i4")
    return (int(head[0]), int(head[1]), int(head[2])) if int(head[0]) in LLMC_MAGICS else None


def _raw_shard(key: str, path: Path, size: int, dtype: str) -> Shard:
    itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size == 0 or size % itemsize:
        raise UserError(f"{key}: {path} has {size} bytes, so it is neither {dtype} token ids (data.token_dtype; a "
                        f"multiple of {itemsize} bytes) nor an llm.c shard ({LLMC_NAMES}); fix: leave it out of the "
                        f"glob, or write it with np.array(ids, dtype=np.{dtype}).tofile(path)")
    return Shard(path, 0, size // itemsize, dtype)


def read_shard(key: str, path: Path, dtype: str = "uint16") -> Shard:
    """The shard's layout, checked against its size: a truncated or foreign file is one line naming it. dtype: a raw
    file's ids (data.token_dtype); an llm.c shard's header says its own."""
    size = path.stat().st_size
    header = _header(path) if size >= 4 else None
    if header is None:
        return _raw_shard(key, path, size, dtype)
    magic, version, count = header
    if (magic, version) not in LLMC_FORMATS:
        raise UserError(f"{key}: {path} is an llm.c shard of magic {magic} version {version}, which distrib does not "
                        f"read (it reads {LLMC_NAMES}); fix: write it with llm.c's data scripts, or leave it out")
    shard = Shard(path, HEADER_BYTES, count, LLMC_FORMATS[magic, version])
    body, want = size - HEADER_BYTES, count * shard.itemsize
    if body < want:
        raise UserError(f"{key}: {path} is truncated: its header says {count} tokens, the file holds "
                        f"{max(body, 0) // shard.itemsize}; fix: copy or write it again")
    if body != want:
        raise UserError(f"{key}: {path} has {body} bytes after its header, which says {count} tokens "
                        f"({want} bytes); fix: write it again, or leave it out of the glob")
    return shard


def _one_format(key: str, shards: list[Shard]) -> None:
    """All raw or all llm.c shards (a file of the other kind is foreign), and all of one id type (one tokenizer)."""
    if len({shard.offset for shard in shards}) > 1:
        first = next(s for s in shards if s.offset)
        raw = next(s for s in shards if not s.offset)
        raise UserError(f"{key}: {raw.path} has no llm.c header ({LLMC_NAMES}) though {first.path} has one; "
                        "fix: give files of one format, or leave the foreign one out of the glob")
    if len({shard.dtype for shard in shards}) > 1:
        first, other = shards[0], next(s for s in shards if s.dtype != shards[0].dtype)
        raise UserError(f"{key}: {other.path} holds {other.dtype} ids though {first.path} holds {first.dtype} ones "
                        "(llm.c shards of two tokenizers); fix: give the shards of one tokenizer")


def find_shards(key: str, pattern: str, dtype: str = "uint16") -> list[Shard]:
    """The files the glob names, sorted, of one format and id type; dtype: raw files' ids (data.token_dtype)."""
    paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())
    if not paths:
        raise UserError(f"{key} = {pattern!r}: matches no file; fix: give a glob of token files, e.g. "
                        "--set 'data.train_files=data/fineweb10B/fineweb_train_*.bin'")
    shards = [read_shard(key, path, dtype) for path in paths]
    _one_format(key, shards)
    return shards


class TokenStream:
    """The shards of one split as one stream of token ids: reads the ids at any positions (an array of any shape,
    each row read as one span) as int64, through os.preadv on files opened on first use in each process. A file cut
    short under the run is one line naming it, where a memory map's read would kill the process with SIGBUS; an id
    at or over vocab_size (when given) is one line naming its file."""

    def __init__(self, shards: list[Shard], key: str = "data.train_files", vocab_size: int = 0):
        self.shards, self.key, self.vocab_size = shards, key, vocab_size
        self.dtype = TOKEN_DTYPES[shards[0].dtype]  # one type per stream (find_shards)
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
        tokens = np.empty(rows.shape, dtype=self.dtype)
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
        """The ids at stream positions [low, high), read from the shards they lie in, from shard `index` on."""
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
        shard = self.shards[index]
        out = np.empty(end - first, dtype=self.dtype) if out is None else out
        if os.preadv(files[index], [out], shard.offset + shard.itemsize * first) < shard.itemsize * (end - first):
            size = os.fstat(files[index]).st_size
            raise UserError(f"{self.key}: {shard.path} was cut short under the run: it holds {size} bytes, "
                            f"{shard.offset + shard.itemsize * shard.num_tokens} when the run opened it; fix: restore "
                            "the file and run the same command again (it resumes from the last checkpoint)")
        return out

    def _out_of_vocabulary(self, ids: np.ndarray, rows: np.ndarray) -> None:
        where = np.unravel_index(int(ids.argmax()), ids.shape)
        largest, position = int(ids[where]), int(rows[where])
        index = int(np.searchsorted(self.starts, position, side="right")) - 1
        raise UserError(f"data.vocab_size = {self.vocab_size}: {self.shards[index].path} holds token id {largest} "
                        f"(its token {position - int(self.starts[index])}); fix: --set data.vocab_size={largest + 1} "
                        "or more (the tokenizer's vocabulary)")


def check_id_type(shards: list[Shard], vocab_size: int) -> None:
    """uint16 ids stop at 65,535: a larger vocabulary says the files hold other ids (uint32 ones read as two halves
    each would train on garbage without any id over the vocabulary to tell)."""
    if vocab_size > 2**16 and shards and shards[0].dtype == "uint16":
        raw = not shards[0].offset
        fix = ("--set data.token_dtype=uint32 if it holds uint32 ids (np.array(ids, dtype=np.uint32).tofile(path)), "
               "or" if raw else "give shards of that tokenizer (llm.c writes Llama 3's as uint32), or")
        raise UserError(f"data.vocab_size = {vocab_size}: {shards[0].path} is read as uint16 token ids "
                        f"({'data.token_dtype' if raw else 'its llm.c header'}), which stop at 65,535; fix: {fix} "
                        "give the vocabulary of the tokenizer that wrote it")


def token_streams(train_files: str, test_files: str, vocab_size: int = 0, dtype: str = "uint16"
                  ) -> tuple[TokenStream, TokenStream]:
    """(train, test) streams of data.train_files and data.test_files (raw files of dtype ids); a file in both is
    refused."""
    train = find_shards("data.train_files", train_files, dtype)
    test = find_shards("data.test_files", test_files, dtype)
    for shards in (train, test):
        check_id_type(shards, vocab_size)
    both = sorted({s.path.resolve() for s in train} & {s.path.resolve() for s in test})
    if both:
        raise UserError(f"data.test_files = {test_files!r}: {both[0]} is also a training file (data.train_files = "
                        f"{train_files!r}); fix: give globs that do not overlap, so the test tokens stay held out")
    return TokenStream(train, "data.train_files", vocab_size), TokenStream(test, "data.test_files", vocab_size)
