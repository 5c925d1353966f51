"""Token files in the formats distrib reads: llm.c's shards (a 256-int32 header: magic, version, token count; then
uint16 ids) and nanoGPT's raw uint16 files; a learnable stream to fill them with; a callback that cuts shards short
under a live run."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

LLMC_MAGIC, LLMC_VERSION = 20240520, 1


def write_llmc(path: Path, ids: np.ndarray, count: int | None = None, magic: int = LLMC_MAGIC,
               version: int = LLMC_VERSION) -> None:
    """An llm.c shard of ids; count (the header's token count) may lie, to make a truncated file."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(ids) if count is None else count
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype="<u2").tobytes())


def learnable_stream(num_tokens: int, vocab_size: int = 64, seed: int = 0) -> np.ndarray:
    """A noisy counter modulo vocab_size: a tiny GPT lowers its loss on it within a few steps."""
    rng = np.random.default_rng(seed)
    return (np.arange(num_tokens) + rng.integers(0, 3, num_tokens)) % vocab_size


def write_llmc_shards(root: Path, stream: np.ndarray, train_sizes: tuple[int, ...], prefix: str = "shard"
                      ) -> tuple[str, str]:
    """The stream cut into llm.c shards: train ones of train_sizes tokens, then one val shard of the rest; returns
    the (train, val) globs."""
    start = 0
    for index, size in enumerate(train_sizes):
        write_llmc(root / f"{prefix}_train_{index:06d}.bin", stream[start:start + size])
        start += size
    write_llmc(root / f"{prefix}_val_000000.bin", stream[start:])
    return str(root / f"{prefix}_train_*.bin"), str(root / f"{prefix}_val_*.bin")


class CutShardsShort:
    """A callback (`train.callbacks = ["tests.helpers.token_shards:CutShardsShort"]`) that cuts the files
    DISTRIB_TEST_CUT_FILES names (os.pathsep between them) down to their llm.c header at the end of step
    DISTRIB_TEST_CUT_AT: a shard truncated under a live run, at an exact step."""

    def on_step_end(self, step: int, loss) -> None:
        if step == int(os.environ["DISTRIB_TEST_CUT_AT"]):
            for path in os.environ["DISTRIB_TEST_CUT_FILES"].split(os.pathsep):
                os.truncate(path, 256 * 4)
