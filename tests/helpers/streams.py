"""Streams for the stream tests (`data.factory = tests.helpers.streams:NAME`, `model.factory =
tests.helpers.streams:id_model`): a plain IterableDataset over shard files, a Hugging Face streaming dataset over
JSON-lines files, bad streams; and a model that records the sample ids it trained on.

DISTRIB_TEST_IDS=folder: the model appends each training forward's ids to folder/ids_rank{RANK}.txt.
DISTRIB_TEST_DIE_AT=N: the worker with RANK=1 sends itself DISTRIB_TEST_DIE_SIGNAL (default SIGTERM) in its Nth
training forward; with DISTRIB_TEST_DIE_ONCE=PATH only if PATH does not exist yet (tests.helpers.dying_model)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import IterableDataset

from tests.helpers.dying_model import first_death

NUM_FEATURES, NUM_CLASSES = 4, 3


def _rows(first_id: int, count: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(first_id)
    ids = torch.arange(first_id, first_id + count)
    return {"x": torch.randn(count, NUM_FEATURES, generator=g), "ids": ids, "labels": ids % NUM_CLASSES}


def write_tensor_shards(folder: Path, sizes: list[int]) -> list[Path]:
    """Shard files of dict rows (torch.save), ids numbered across the files."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for index, size in enumerate(sizes):
        paths.append(folder / f"shard_{index:03d}.pt")
        torch.save(_rows(first, size), paths[-1])
        first += size
    return paths


def write_jsonl_shards(folder: Path, sizes: list[int]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for index, size in enumerate(sizes):
        rows = _rows(first, size)
        paths.append(folder / f"part_{index}.jsonl")
        with open(paths[-1], "w") as f:
            for i in range(size):
                f.write(json.dumps({key: value[i].tolist() for key, value in rows.items()}) + "\n")
        first += size
    return paths


class FileStream(IterableDataset):
    """A plain stream: knows nothing of ranks or workers; reads its files in order, one row at a time."""

    def __init__(self, paths: list[str], bad_after: int = -1):
        self.paths, self.bad_after = paths, bad_after

    def __iter__(self):
        count = 0
        for path in self.paths:
            rows = torch.load(path, weights_only=True)
            for i in range(len(rows["ids"])):
                row = {key: value[i] for key, value in rows.items()}
                if count == self.bad_after:
                    row = (row["x"], "not a tensor")  # a wrong structure, halfway
                count += 1
                yield row


def _test_split() -> dict[str, torch.Tensor]:
    return _rows(10_000, 24)


def plain(folder: str, bad_after: int = -1):
    return FileStream(sorted(str(p) for p in Path(folder).glob("shard_*.pt")), bad_after), _test_split()


def empty(folder: str):
    return FileStream([]), _test_split()


def hugging_face(folder: str):
    from datasets import load_dataset

    files = sorted(str(p) for p in Path(folder).glob("part_*.jsonl"))
    return load_dataset("json", data_files=files, streaming=True, split="train"), _test_split()


class IdModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(NUM_FEATURES, NUM_CLASSES)
        self.num_forwards = 0
        folder = os.environ.get("DISTRIB_TEST_IDS")
        self.ids_file = Path(folder) / f"ids_rank{os.environ.get('RANK', '0')}.txt" if folder else None
        die_at = int(os.environ.get("DISTRIB_TEST_DIE_AT", "0"))
        self.die_at = die_at if os.environ.get("RANK", "0") == "1" else 0
        self.signum = signal.Signals[os.environ.get("DISTRIB_TEST_DIE_SIGNAL", "SIGTERM")]

    def forward(self, x, ids, labels=None):
        if self.training:
            self.num_forwards += 1
            if self.ids_file is not None:
                with open(self.ids_file, "a") as f:
                    f.write(" ".join(str(i) for i in ids.tolist()) + "\n")
            if self.num_forwards == self.die_at and first_death():
                os.kill(os.getpid(), self.signum)
        return self.linear(x.float())


def id_model():
    return IdModel()
