"""Token files in the formats distrib reads: llm.c's shards (a 256-int32 header: magic, version, token count; then
the ids: GPT-2's uint16, Llama 3's uint32) and raw files of ids (nanoGPT's uint16); a learnable stream to fill them
with; a callback that cuts shards short under a live run."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

LLMC_MAGIC, LLMC_VERSION = 20240520, 1  # llm.c's GPT-2 shards: uint16 ids
LLAMA3 = {"magic": 20240801, "version": 7}  # llm.c's Llama 3 shards: uint32 ids (write_llmc(..., **LLAMA3))
LLAMA3_VOCAB = 128_256


def write_llmc(path: Path, ids: np.ndarray, count: int | None = None, magic: int = LLMC_MAGIC,
               version: int = LLMC_VERSION) -> None:
    """An llm.c shard of ids (uint32 for Llama 3's magic and version, else uint16); count (the header's token count)
    may lie, to make a truncated file."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    dtype = "<u4" if {"magic": magic, "version": version} == LLAMA3 else "<u2"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype=dtype).tobytes())


def learnable_stream(num_tokens: int, vocab_size: int = 64, seed: int = 0) -> np.ndarray:
    """A noisy counter modulo vocab_size: a tiny GPT lowers its loss on it within a few steps."""
    rng = np.random.default_rng(seed)
    return (np.arange(num_tokens) + rng.integers(0, 3, num_tokens)) % vocab_size


def write_llmc_shards(root: Path, stream: np.ndarray, train_sizes: tuple[int, ...], prefix: str = "shard",
                      **header: int) -> tuple[str, str]:
    """The stream cut into llm.c shards (header: write_llmc's magic and version): train ones of train_sizes tokens,
    then one val shard of the rest; returns the (train, val) globs."""
    start = 0
    for index, size in enumerate(train_sizes):
        write_llmc(root / f"{prefix}_train_{index:06d}.bin", stream[start:start + size], **header)
        start += size
    write_llmc(root / f"{prefix}_val_000000.bin", stream[start:], **header)
    return str(root / f"{prefix}_train_*.bin"), str(root / f"{prefix}_val_*.bin")


class CutShardsShort:
    """A callback (`train.callbacks = ["tests.helpers.token_shards:CutShardsShort"]`) that cuts the files
    DISTRIB_TEST_CUT_FILES names (os.pathsep between them) down to their llm.c header at the end of step
    DISTRIB_TEST_CUT_AT: a shard truncated under a live run, at an exact step."""

    def on_step_end(self, step: int, loss) -> None:
        if step == int(os.environ["DISTRIB_TEST_CUT_AT"]):
            for path in os.environ["DISTRIB_TEST_CUT_FILES"].split(os.pathsep):
                os.truncate(path, 256 * 4)
