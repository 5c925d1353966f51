"""Samples into one micro-batch on the DataLoader path: dict samples of 1-D token tensors of different lengths padded
to the longest in the micro-batch (right-padded: input_ids with data.pad_id, attention_mask 0, labels -100), or the
user's own collate function (data.collate, fit(collate_fn=...)), e.g. a Hugging Face data collator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch

from distrib.data import samples
from distrib.data.batching import Failed, collate
from distrib.errors import UserError
from distrib.factory import import_object

IGNORE_INDEX = -100  # labels on padding: the loss does not count them
MASK_KEY, LABELS_KEY, IDS_KEY = "attention_mask", samples.LABELS, "input_ids"


def pad_values(pad_id: int) -> dict[str, int]:
    """What padding holds, by key (any other key: 0)."""
    return {IDS_KEY: pad_id, MASK_KEY: 0, LABELS_KEY: IGNORE_INDEX}


def _ragged(batch: list) -> bool:
    """Dict samples whose 1-D tensors differ in length (within a sample or across samples)."""
    if not all(isinstance(item, dict) and item for item in batch):
        return False
    lengths = {len(value) for item in batch for value in item.values()
               if isinstance(value, torch.Tensor) and value.dim() == 1}
    return len(lengths) > 1 and all(value.dim() == 1 for item in batch for value in item.values()
                                    if isinstance(value, torch.Tensor))


def pad(batch: list[dict], pad_id: int = 0) -> list[dict]:
    """Every 1-D tensor of every sample right-padded to the longest; an attention_mask added (1 on the sample's
    tokens) where the samples have input_ids and none. Right padding leaves every real position where it was, so a
    causal model's outputs there, and the loss over them, do not depend on how long the micro-batch's longest is."""
    values = pad_values(pad_id)
    longest = max(len(value) for item in batch for value in item.values())
    padded = []
    for item in batch:
        if IDS_KEY in item and MASK_KEY not in item:
            item = {**item, MASK_KEY: torch.ones(len(item[IDS_KEY]), dtype=torch.long)}
        padded.append({key: torch.cat([value, value.new_full((longest - len(value),), values.get(key, 0))])
                       for key, value in item.items()})
    return padded


class Collate:
    """The DataLoader's collate_fn (picklable, for worker processes): the user's function when one is given (its
    result a dict of tensors, e.g. a BatchEncoding, or an (inputs, targets) pair), else padding of ragged dict
    samples, then distrib's stacking."""

    def __init__(self, pad_id: int = 0, user: Callable | None = None, where: str = "data.collate"):
        self.pad_id, self.user, self.where = pad_id, user, where

    def __call__(self, batch):
        if isinstance(batch, tuple):  # gathered whole (an in-memory split): nothing to collate
            return batch
        failed = next((item for item in batch if isinstance(item, Failed)), None)
        if failed is not None:
            return failed
        if self.user is not None:
            return self._user(batch)
        return collate(pad(batch, self.pad_id) if _ragged(batch) else batch)

    def _user(self, batch):
        try:
            result = self.user(batch)
        except Exception as e:  # noqa: BLE001 - the user's function: one line in the main process
            return Failed(f"{self.where}: raised {type(e).__name__}: {str(e).strip()[:160]} on a batch of "
                          f"{len(batch)} samples; fix the collate function")
        if isinstance(result, Mapping) and samples.is_tree(dict(result)):
            return dict(result), None  # the labels, if any, are in the dict
        if isinstance(result, (tuple, list)) and len(result) == 2 and samples.is_tree(result[0]) \
                and (result[1] is None or samples.is_tree(result[1])):
            return tuple(result)
        return Failed(f"{self.where}: returned {type(result).__name__}; fix: return a dict of tensors (e.g. a Hugging "
                      "Face BatchEncoding) or an (inputs, targets) pair of batched tensors")


def user_collate(spec: str) -> Callable | None:
    """data.collate's function ("package.module:function"), or None when unset."""
    if not spec:
        return None
    return import_object("data.collate", spec)


def collate_for(pad_id: int, spec: str = "", function: Callable | None = None) -> Collate:
    """fit(collate_fn=...) wins over data.collate."""
    if function is not None:
        if not callable(function):
            raise UserError(f"fit(collate_fn={function!r}): not callable; fix: give a function of a list of samples")
        return Collate(pad_id, function, f"fit(collate_fn={getattr(function, '__qualname__', repr(function))})")
    return Collate(pad_id, user_collate(spec), f"data.collate = {spec!r}")
