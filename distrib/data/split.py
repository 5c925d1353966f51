"""A validation split: data.val_fraction of the training samples held out by a permutation of their indices seeded by
a constant (the same samples at any world size, for any train.seed), or a third dataset (a factory's (train, val,
test), fit(val_data=...)). Training reports val_* after each evaluation; the test set is evaluated at the end."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from distrib.config import DataConfig
from distrib.data.assemble import Data
from distrib.data.batching import Batch, BatchSource
from distrib.errors import UserError

SPLIT_SEED = 20_240_520  # a constant, not train.seed: runs of other seeds hold out the same samples


class Subset:
    """The samples `indices` of another batch source, as a batch source of their own (sample i is indices[i], so
    augmentation stays keyed by the sample's index in the whole set)."""

    def __init__(self, source: BatchSource, indices: torch.Tensor):
        self.source, self.indices = source, indices
        self.num_samples = len(indices)

    def batches(self, index_lists: list[torch.Tensor], epoch: int | None = None) -> Iterator[Batch]:
        return self.source.batches([self.indices[idx] for idx in index_lists], epoch)


def held_out(num_samples: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training indices, validation indices), each sorted: round(num_samples x fraction) (at least 1) of them held
    out by one seeded permutation."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(SPLIT_SEED))
    num_val = max(1, round(num_samples * fraction))
    return order[num_val:].sort().values, order[:num_val].sort().values


def split_validation(data: Data, config: DataConfig) -> Data:
    """data with data.val_fraction of its training samples as the validation set (unchanged when it is 0)."""
    if not config.val_fraction:
        return data
    where = f"data.val_fraction = {config.val_fraction}"
    if data.val is not None:
        raise UserError(f"{where}: the data has a validation set of its own already (from the factory or "
                        "fit(val_data=...)); fix: --set data.val_fraction=0, or give no validation set")
    if data.train.num_samples is None:
        raise UserError(f"{where}: the training data is a stream, whose samples have no index to hold some out by; "
                        "fix: --set data.val_fraction=0 and give a validation set (a data.factory's (train, val, "
                        "test), or fit(val_data=...))")
    if config.name in ("text", "tokens") and not config.factory:
        raise UserError(f"{where}: {config.name} windows start anywhere in the stream, so held-out windows would "
                        "overlap trained ones; fix: --set data.val_fraction=0 (the test stream is evaluated)")
    train, val = held_out(data.train.num_samples, config.val_fraction)
    if len(train) == 0:
        raise UserError(f"{where}: leaves no training samples of {data.train.num_samples}; fix: a smaller fraction")
    return dataclasses.replace(data, train=Subset(data.train, train), val=Subset(data.train, val))
