"""Tokens/s of reading training windows from token shards: distrib's checked reads (os.preadv, one read per window:
distrib.data.token_files.TokenStream) against the memory maps it used before (numpy fancy indexing, which ends the
process with SIGBUS when a file shrinks under it), in alternating repeats, medians reported.

    python scripts/bench_token_reads.py [--tokens 100_000_000] [--repeats 7] [--batches 100]

Four llm.c shards of random ids are written to a temporary folder (2 bytes a token) and read from the page cache
(read whole once first); the two readers take turns reading first, on the same windows."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distrib.data.text import window_starts  # noqa: E402 - the repository is on the path now
from distrib.data.token_files import LLMC_MAGIC, LLMC_VERSION, TokenStream, find_shards  # noqa: E402

SHAPES = ((8, 1024), (12, 1024), (64, 256), (32, 64))  # (windows a batch, seq_len)


def write_shards(root: Path, num_tokens: int) -> None:
    rng = np.random.default_rng(0)
    header = np.zeros(256, dtype="<i4")
    for index in range(4):
        header[:3] = LLMC_MAGIC, LLMC_VERSION, num_tokens // 4
        ids = rng.integers(0, 50257, num_tokens // 4).astype("<u2")
        (root / f"shard_{index}.bin").write_bytes(header.tobytes() + ids.tobytes())


def memmap_reader(stream: TokenStream):
    """The reads as distrib did them before: a memory map per shard, the positions gathered from it."""
    maps = [np.memmap(s.path, dtype=np.uint16, mode="r", offset=s.offset, shape=(s.num_tokens,)) for s in stream.shards]

    def read(positions: np.ndarray) -> np.ndarray:
        which = np.searchsorted(stream.starts, positions, side="right") - 1
        ids = np.empty(positions.shape, dtype=np.int64)
        for shard in np.unique(which):
            here = which == shard
            ids[here] = maps[shard][positions[here] - stream.starts[shard]]
        return ids

    return read


def tokens_per_second(read, num_tokens: int, batch: int, seq_len: int, num_batches: int, seed: int) -> float:
    offsets = np.arange(seq_len + 1)
    start = time.perf_counter()
    for step in range(num_batches):
        starts = window_starts(seed, 0, np.arange(step * batch, (step + 1) * batch), num_tokens - seq_len)
        read(starts[:, None] + offsets)
    return num_batches * batch * (seq_len + 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        write_shards(Path(folder), args.tokens)
        for path in Path(folder).iterdir():  # into the page cache: the reads are measured, not the disk
            path.read_bytes()
        stream = TokenStream(find_shards("bench", f"{folder}/shard_*.bin"))
        readers = {"memmap": memmap_reader(stream), "pread": stream}
        print("windows x seq_len   memmap M tokens/s   pread M tokens/s")
        for batch, seq_len in SHAPES:
            rates = {name: [] for name in readers}
            for repeat in range(args.repeats):
                order = list(readers) if repeat % 2 else list(readers)[::-1]  # neither always reads first
                for name in order:
                    rates[name].append(tokens_per_second(readers[name], stream.num_tokens, batch, seq_len,
                                                         args.batches, repeat))
            medians = {name: statistics.median(values) / 1e6 for name, values in rates.items()}
            print(f"{batch:7d} x {seq_len:<7d}   {medians['memmap']:17.1f}   {medians['pread']:16.1f}")


if __name__ == "__main__":
    main()
