"""Data whose kind the padding rule must get right, for tests/unit/test_stream_kinds.py and the world-size-2 runs of
tests/integration/test_tasks.py and test_streams.py:
- a plain stream of dict samples of 16 ids, every third run of four shorter (`ragged_ids`), a map-style test set of
  ids of 5 to 16 (`ragged_test`, a Python list), and a causal model that takes no `labels` and needs its
  `attention_mask` (`CausalBag`): the labels are the targets, and every micro-batch must carry a mask;
- a plain stream whose feature vectors grow from 4 to 5 at a batch boundary (`data.factory =
  tests.helpers.stream_kinds:features_grow`);
- JSON-lines files whose last one's `labels` column turns from integers to strings (`write_bad_jsonl`, read by
  `tests.helpers.streams:hugging_face`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import IterableDataset

from tests.helpers.streams import NUM_FEATURES, FileStream, _test_split, write_jsonl_shards, write_tensor_shards

VOCAB, LENGTH, RUN = 32, 16, 4


def _ids(index: int, length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (length,), generator=torch.Generator().manual_seed(index))


class RaggedIds(IterableDataset):
    """Samples of 16 ids, but every third run of four: each of those of 9 to 15 (their run's own length)."""

    def __init__(self, count: int):
        self.count = count

    def __iter__(self):
        for index in range(self.count):
            run = index // RUN
            length = LENGTH if run % 3 != 2 else 9 + run % 7
            ids = _ids(index, length)
            yield {"input_ids": ids, "labels": ids.clone()}


def ragged_ids(count: int = 160) -> RaggedIds:
    return RaggedIds(count)


def ragged_test(count: int = 20) -> list[dict[str, torch.Tensor]]:
    """A map-style test set as a plain list of dict samples of 5 to 16 ids."""
    return [{"input_ids": (ids := _ids(10_000 + index, 5 + index % 12)), "labels": ids.clone()}
            for index in range(count)]


class CausalBag(nn.Module):
    """Each position's logits from the mean of the embeddings up to it (causal, so right padding changes no real
    position). forward takes no labels, and needs the attention_mask: a micro-batch without one is a TypeError."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask):
        assert attention_mask.shape == input_ids.shape
        x = self.embed(input_ids).cumsum(1) / torch.arange(1, input_ids.shape[1] + 1).view(1, -1, 1)
        return self.head(x)


def loss_of_each_alone(model: nn.Module, test: list[dict]) -> float:
    """The mean cross-entropy over every test position, each sample alone and unpadded."""
    with torch.no_grad():
        sums = [F.cross_entropy(model(s["input_ids"][None], torch.ones(1, len(s["input_ids"]), dtype=torch.long))[0],
                                s["labels"], reduction="sum") for s in test]
    return (sum(sums) / sum(len(s["labels"]) for s in test)).item()


def features_grow(folder: str, grow_after: int = 288):
    """A plain stream of {x, ids, labels} whose x has 5 features from sample `grow_after` on (a batch boundary)."""
    write_tensor_shards(Path(folder), [100] * 4)
    return GrowingFeatures(sorted(str(p) for p in Path(folder).glob("shard_*.pt")), grow_after), _test_split()


class GrowingFeatures(FileStream):
    def __init__(self, paths: list[str], grow_after: int):
        super().__init__(paths)
        self.grow_after = grow_after

    def __iter__(self):
        for index, row in enumerate(super().__iter__()):
            if index >= self.grow_after:
                row = {**row, "x": torch.cat([row["x"], torch.zeros(1)])}
            yield row


def write_bad_jsonl(folder: Path, sizes: list[int], bad: str = "type") -> list[Path]:
    """JSON-lines files of {x, ids, labels} (tests.helpers.streams's); the last one's labels are strings (bad =
    "type"), or its rows have an extra key (bad = "key")."""
    paths = write_jsonl_shards(folder, sizes)
    rows = [json.loads(line) for line in paths[-1].read_text().splitlines()]
    changed = [{**row, "labels": f"class {row['labels']}"} if bad == "type" else {**row, "extra": 1} for row in rows]
    paths[-1].write_text("".join(json.dumps(row) + "\n" for row in changed))
    return paths


assert NUM_FEATURES == 4  # features_grow grows them to 5
