"""The data's kind on the host: a Dataset read whole into tensors for the device path, the first sample as a batch of
one (what the kind is read from), and train and test checked to be of one kind."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.utils.data import DataLoader, Dataset

from distrib.config import DataConfig
from distrib.data import samples
from distrib.data.batching import Failed, collate, init_worker
from distrib.data.collate import Collate, with_mask
from distrib.data.tensors import Split
from distrib.errors import UserError


def materialize(split: Split | Dataset, config: DataConfig, collate_fn: Collate | None = None) -> Split:
    """A Dataset read whole into tensors (through a DataLoader with data.num_workers), for the device path: padded
    to its longest where the data's kind is (collate_fn.padded), each sample checked against the first one's kind."""
    own = replace(collate_fn, user=None) if collate_fn is not None else Collate(config.pad_id)
    if isinstance(split, Split):
        return with_mask(split) if own.padded else split
    own = own.expecting(split)
    loader = DataLoader(split, batch_size=256, collate_fn=list if own.padded else own,
                        num_workers=config.num_workers, worker_init_fn=init_worker)
    if own.padded:  # one micro-batch of every sample: padded to the split's longest
        batch = checked(own([row for rows in loader for row in rows]))
        return Split(*batch)
    inputs, targets = [], []
    for batch in loader:
        batch = checked(batch)
        inputs.append(batch[0])
        targets.append(batch[1])
    kinds = sorted({samples.kind(x) for x in inputs})
    if len(kinds) > 1:
        raise UserError(f"data: samples of different shapes or types ({'; '.join(kinds[:3])}); fix: give samples "
                        "of one shape (pad or cut sequences to one length)")
    return Split(samples.cat(inputs), None if targets[0] is None else samples.cat(targets))


def first_batch(split: Split | Dataset, collate_fn=collate):
    """The first sample as a batch of one (inputs, targets), targets resolved: what the data's kind is read from."""
    if isinstance(split, Split):
        return samples.resolve(*split.rows(torch.arange(1)))
    return samples.resolve(*checked(collate_fn([split[0]])))


def same_kind(name: str, train, test) -> None:
    """Train's first batch and test's (or validation's) of one kind, or a one-line error naming both."""
    for part, what in ((0, "inputs"), (1, "targets")):
        if part == 1 and isinstance(train[0], dict):
            continue  # a dict sample's labels are inside it: compared with the inputs
        kinds = [_described(batch[part]) for batch in (train, test)]
        if kinds[0] != kinds[1]:
            raise UserError(f"data {name}: train {what} are {kinds[0]}, test {what} {kinds[1]}; fix: give both "
                            f"splits {what} of one shape and type")


def _described(tree) -> str:
    """'[3, 8, 8] float' for float and uint8 tensors, as the seed said it; 'int64 [64]' and dicts otherwise."""
    if isinstance(tree, torch.Tensor) and (tree.is_floating_point() or tree.dtype == torch.uint8):
        return f"{list(tree.shape[1:])} {'uint8' if tree.dtype == torch.uint8 else 'float'}"
    if isinstance(tree, dict):  # token samples may differ in length (they are padded): keys, types and ranks agree
        return "{" + ", ".join(f"{key}: {str(value.dtype).removeprefix('torch.')} of {value.dim() - 1} dims"
                               for key, value in tree.items()) + "}"
    return samples.kind(tree)


def checked(batch):
    """The batch, or the one-line error of a sample a DataLoader worker could not read (batching.Failed)."""
    if isinstance(batch, Failed):
        raise UserError(batch.message)
    return batch
