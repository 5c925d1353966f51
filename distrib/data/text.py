"""Language-model data: `text` (a UTF-8 file or folder of .txt files as bytes, vocabulary 256) and `tokens` (nanoGPT's
train.bin / val.bin of ids, uint16 unless data.token_dtype says uint32, or the shards data.train_files /
data.test_files name, all read window by window as token_files.py reads them), cut into windows of data.seq_len + 1
tokens.

A training sample is a window whose start comes from (seed, epoch, sample index) by a counter-based hash, so any
rank computes any sample's window alone: the order is the same at every world size and resumes exactly. The test
stream is cut into consecutive windows, the last one padded with targets of -100 (not counted), so evaluation
predicts every held-out token exactly once. With data.document_mask the inputs are {input_ids, position_ids}, the
positions restarting at each document (distrib.data.documents)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from distrib.config import DataConfig
from distrib.data.batching import Batch
from distrib.data.documents import Documents
from distrib.data.tensors import DataInfo
from distrib.data.token_files import Shard, TokenStream, check_id_type, token_streams
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError

IGNORE_INDEX = -100  # targets the loss does not count (padding of the last test window)
BYTE_VOCAB = 256
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64: uint64 in, well-mixed uint64 out (wrapping arithmetic, as the algorithm wants)."""
    with np.errstate(over="ignore"):
        x = x + _GAMMA
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def window_starts(seed: int, epoch: int, indices: np.ndarray, num_starts: int) -> np.ndarray:
    """The first token of each training sample's window: a hash of (seed, epoch, sample index) modulo num_starts
    (a bias of at most num_starts / 2^64), so no rank needs any other sample's draw."""
    with np.errstate(over="ignore"):
        key = _splitmix(_splitmix(np.uint64(seed)) + np.uint64(epoch))
        return (_splitmix(indices.astype(np.uint64) + key) % np.uint64(num_starts)).astype(np.int64)


class TokenWindows:
    """A BatchSource over one token stream. Training (an epoch given): (num_tokens - 1) // seq_len windows at hashed
    starts. Evaluation (epoch None): consecutive windows covering every target token once. Yields (inputs [B, T],
    targets [B, T]) int64 on the runtime's device. `paths`: the files the tokens were read from (the data's
    identity in a checkpoint)."""

    def __init__(self, read: Callable[[np.ndarray], torch.Tensor], num_tokens: int, seq_len: int, seed: int,
                 runtime: Runtime, training: bool, paths: tuple[Path, ...] = (), documents: Documents | None = None):
        self.read, self.num_tokens, self.seq_len, self.seed = read, num_tokens, seq_len, seed
        self.device, self.paths, self.documents = runtime.device, paths, documents
        targets = num_tokens - 1  # every token but the first is some window's target
        self.num_samples = targets // seq_len if training else -(-targets // seq_len)

    def batches(self, index_lists: list[torch.Tensor], epoch: int | None = None) -> Iterator[Batch]:
        offsets = np.arange(self.seq_len + 1)
        for idx in index_lists:
            indices = idx.numpy().astype(np.int64)
            if epoch is None:
                starts = indices * self.seq_len
            else:
                starts = window_starts(self.seed, epoch, indices, self.num_tokens - self.seq_len)
            positions = starts[:, None] + offsets  # [B, T + 1]
            beyond = positions >= self.num_tokens  # only in the last test window
            windows = self.read(np.minimum(positions, self.num_tokens - 1))
            windows = windows.to(self.device, non_blocking=True)
            inputs, targets = windows[:, :-1], windows[:, 1:]
            if beyond.any():  # only the last test window: its positions past the stream count for nothing
                targets = targets.masked_fill(torch.from_numpy(beyond[:, 1:]).to(self.device), IGNORE_INDEX)
            yield (inputs if self.documents is None else self.documents.inputs(inputs, positions[:, :-1])), targets


# ---------------------------------------------------------------- text: bytes of UTF-8 files


def _text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise UserError(f"data.root = {str(root)!r}: no such file or folder; fix: give a UTF-8 text file or a folder "
                        "of .txt files, e.g. --set data.root=input.txt")
    files = sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not files:
        raise UserError(f"data.root = {str(root)!r}: holds no .txt files; fix: give a text file or a folder of .txt "
                        "files")
    return files


def read_text(root: Path) -> bytes:
    """The bytes of the file, or of the folder's .txt files in sorted path order; each must be UTF-8."""
    parts = []
    for path in _text_files(root):
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"data.root: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                            "fix: save it as UTF-8 or leave it out") from None
        parts.append(data)
    return b"".join(parts)


def _too_short(what: str, num_tokens: int, seq_len: int) -> UserError:
    return UserError(f"data.seq_len = {seq_len}: {what} has only {num_tokens} tokens, too few for one window of "
                     f"{seq_len} + 1; fix: --set data.seq_len={max(1, num_tokens - 2)} or give more data")


def text_streams(config: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test) byte streams: the last data.test_fraction of the bytes is held out; the test stream starts one
    byte early, so that every held-out byte is a target."""
    data = torch.frombuffer(bytearray(read_text(Path(config.root))), dtype=torch.uint8)
    split = len(data) - max(1, round(len(data) * config.test_fraction))
    train, test = data[:split], data[max(0, split - 1):]
    if len(train) < config.seq_len + 2:
        raise _too_short(f"the training text of {config.root} ({len(data)} bytes, {1 - config.test_fraction:.0%} "
                         "kept for training)", len(train), config.seq_len)
    return train, test


def _on_device(tokens: torch.Tensor, device: torch.device) -> Callable[[np.ndarray], torch.Tensor]:
    stream = tokens.to(device)  # a text is small: all of it on the device, windows gathered there

    def read(positions: np.ndarray) -> torch.Tensor:
        return stream[torch.from_numpy(positions).to(device)].long()

    return read


# ---------------------------------------------------------------- tokens: nanoGPT's train.bin / val.bin


def open_tokens(root: Path, name: str, config: DataConfig) -> TokenStream:
    """nanoGPT's train.bin or val.bin (ids of data.token_dtype) as a stream of one raw shard (never taken for an
    llm.c shard)."""
    path, dtype = root / name, config.token_dtype
    if not path.is_file():
        raise UserError(f"data.root = {str(root)!r}: no {name}; fix: give the folder holding nanoGPT's train.bin and "
                        "val.bin (uint16 token ids, as its prepare.py writes them)")
    shard = Shard(path, 0, 0, dtype)
    size = path.stat().st_size
    if size % shard.itemsize:
        raise UserError(f"data.root: {path} has {size} bytes, not a multiple of {shard.itemsize}, so it is not "
                        f"{dtype} token ids (data.token_dtype); fix: write it with np.array(ids, dtype=np.{dtype})"
                        ".tofile(path)")
    shard = Shard(path, 0, size // shard.itemsize, dtype)
    check_id_type([shard], config.vocab_size)
    if shard.num_tokens < (config.seq_len + 2 if name == "train.bin" else 2):
        raise _too_short(str(path), shard.num_tokens, config.seq_len)
    return TokenStream([shard], "data.root", config.vocab_size)  # windows read as batches need them


# ---------------------------------------------------------------- both


def token_info(name: str, seq_len: int, vocab_size: int) -> DataInfo:
    """What a model is told about token data: sequences [seq_len] of ids below vocab_size, no normalisation."""
    kind = f"int64 [{seq_len}]"  # inputs and targets alike
    return DataInfo(name, (seq_len,), vocab_size, (), (), (), inputs=kind, targets=kind)


def token_data(config: DataConfig, runtime: Runtime, seed: int) -> tuple[DataInfo, TokenWindows, TokenWindows]:
    """The DataInfo and the (train, test) batch sources of data.name = text or tokens."""
    seq_len = config.seq_len
    if config.name == "text":
        train, test = text_streams(config)
        vocab_size, files = BYTE_VOCAB, tuple(_text_files(Path(config.root)))
        reads = [(_on_device(s, runtime.device), len(s), files) for s in (train, test)]
        sizes = np.array([path.stat().st_size for path in files], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # where each file starts in the joined bytes
        file_offsets = [offsets, offsets - (int(sizes.sum()) - len(test))]  # the test stream starts later
    elif config.train_files:
        vocab_size = config.vocab_size
        streams = token_streams(config.train_files, config.test_files, vocab_size, config.token_dtype)
        for (key, pattern), stream, least in zip((("train_files", config.train_files),
                                                   ("test_files", config.test_files)), streams, (seq_len + 2, 2)):
            if stream.num_tokens < least:
                raise _too_short(f"data.{key} = {pattern!r}", stream.num_tokens, seq_len)
        reads = [(stream, stream.num_tokens, tuple(shard.path for shard in stream.shards)) for stream in streams]
        file_offsets = [stream.starts for stream in streams]
    else:
        root, vocab_size = Path(config.root), config.vocab_size
        streams = [open_tokens(root, name, config) for name in ("train.bin", "val.bin")]
        reads = [(stream, stream.num_tokens, (stream.shards[0].path,)) for stream in streams]
        file_offsets = [stream.starts for stream in streams]
    info = token_info(config.name, seq_len, vocab_size)
    documents = [Documents(config.eos_id, offsets) if config.document_mask else None for offsets in file_offsets]
    sources = [TokenWindows(read, num_tokens, seq_len, seed, runtime, training, paths, packed)
               for (read, num_tokens, paths), training, packed in zip(reads, (True, False), documents)]
    return info, sources[0], sources[1]
