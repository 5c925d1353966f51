"""Samples into one micro-batch on the DataLoader path, by the data's kind (learnt once from its first samples, or
declared by data.pad), never by one micro-batch's luck: dict samples whose 1-D ids differ in length are padded in
every micro-batch to its longest (right-padded: input_ids with data.pad_id, attention_mask 0, labels -100, the mask
always present), and every sample is checked against its split's kind (keys, dtypes, sizes; a padded length is any
length). Or the user's own collate function (data.collate, fit(collate_fn=...)), e.g. a Hugging Face data collator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Callable

import torch

from distrib.data import samples
from distrib.data.batching import Failed, collate
from distrib.data.tensors import Split
from distrib.errors import UserError
from distrib.factory import import_object

IGNORE_INDEX = -100  # labels on padding: the loss does not count them
MASK_KEY, LABELS_KEY, IDS_KEY = "attention_mask", samples.LABELS, "input_ids"
ANY_LENGTH = "*"  # a padded length, in a kind
PROBE = 256  # samples spread over a map-style dataset of dict samples of ids: whether their lengths differ


def pad_values(pad_id: int) -> dict[str, int]:
    """What padding holds, by key (any other key: 0)."""
    return {IDS_KEY: pad_id, MASK_KEY: 0, LABELS_KEY: IGNORE_INDEX}


def paddable(value) -> bool:
    """A dict sample's tensor that padding lengthens: 1-D ids, a mask, labels (integers). Float features are never
    padded: a feature vector of another length is another kind of sample."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point() \
        and not value.is_complex()


def lengths_differ(rows: list) -> bool:
    """Dict samples whose paddable tensors differ in length (within a sample or across samples)."""
    lengths = {len(value) for item in rows if isinstance(item, dict) for value in item.values() if paddable(value)}
    return len(lengths) > 1


def kind_of(sample, padded: bool) -> str | None:
    """A sample's kind, '{input_ids: int64 [*], labels: int64 []}' or 'float32 [4] -> int64 []' (padded lengths as
    *); None for what is no sample."""
    pair = samples.as_pair(sample)
    if pair is None:
        return None
    if isinstance(sample, dict):
        return _tree_kind(sample, padded)
    return f"{_tree_kind(pair[0], False)} -> {_tree_kind(pair[1], False)}"


def _tree_kind(tree, padded: bool) -> str:
    if isinstance(tree, torch.Tensor):
        dtype = str(tree.dtype).removeprefix("torch.")
        sizes = [ANY_LENGTH] if padded and paddable(tree) else [str(size) for size in tree.shape]
        return f"{dtype} [{', '.join(sizes)}]"
    return "{" + ", ".join(f"{key}: {_tree_kind(value, padded)}" for key, value in tree.items()) + "}"


def pad(batch: list[dict], pad_id: int = 0) -> list[dict]:
    """Every paddable tensor of every dict sample right-padded to the longest; an attention_mask added (1 on the
    sample's tokens) where the samples have input_ids and none. Right padding leaves every real position where it
    was, so a causal model's outputs there, and the loss over them, do not depend on how long the micro-batch's
    longest is."""
    values = pad_values(pad_id)
    longest = max((len(value) for item in batch for value in item.values() if paddable(value)), default=0)
    padded = []
    for item in batch:
        if IDS_KEY in item and MASK_KEY not in item and paddable(item[IDS_KEY]):
            item = {**item, MASK_KEY: torch.ones(len(item[IDS_KEY]), dtype=torch.long)}
        padded.append({key: torch.cat([value, value.new_full((longest - len(value),), values.get(key, 0))])
                       if paddable(value) else value for key, value in item.items()})
    return padded


@dataclass(frozen=True)
class Collate:
    """The DataLoader's collate_fn (picklable, for worker processes): the user's function when one is given (its
    result a dict of tensors, e.g. a BatchEncoding, or an (inputs, targets) pair), else distrib's stacking, with dict
    samples padded when the data's kind is (`padded`) and every sample checked against its split's kind
    (`expected`, '' = unchecked), so that every micro-batch of a split has one structure."""

    pad_id: int = 0
    user: Callable | None = None
    where: str = "data.collate"
    padded: bool = False
    expected: str = ""
    loose: str = ""  # the expected kind with its paddable lengths as any length

    def expecting(self, split) -> Collate:
        """This collate for a split (a dataset, or a list of samples) whose samples are all of its first one's kind;
        a Split is stacked already."""
        if isinstance(split, Split):
            return self
        sample = split[0]
        return replace(self, expected=kind_of(sample, self.padded) or "", loose=kind_of(sample, True) or "")

    def learnt(self, rows: list, declared: str = "auto") -> Collate:
        """This collate with the data's kind learnt from `rows` (samples of every split) or declared (data.pad =
        always): padded once any dict samples' ids differ in length, and from then on in every micro-batch."""
        if self.user is not None:
            return self  # the user's function makes the batches
        dicts = [row for row in rows if isinstance(row, dict)]
        ids = any(paddable(value) for row in dicts[:1] for value in row.values())
        if declared == "always" and rows and not ids:
            raise UserError(f"data.pad = 'always': the samples are {kind_of(rows[0], False) or type(rows[0]).__name__}"
                            ", not dicts of 1-D ids, which is what distrib pads; fix: --set data.pad=auto")
        return replace(self, padded=self.padded or ids and (declared == "always" or lengths_differ(dicts)))

    def __call__(self, batch):
        if isinstance(batch, tuple):  # gathered whole (an in-memory split): nothing to collate
            return batch
        failed = next((item for item in batch if isinstance(item, Failed)), None)
        if failed is not None:
            return failed
        if self.user is not None:
            return self._user(batch)
        wrong = self._unlike(batch)
        if wrong is not None:
            return wrong
        return collate(pad(batch, self.pad_id) if self.padded and isinstance(batch[0], dict) else batch)

    def _unlike(self, batch) -> Failed | None:
        """The first sample not of the split's kind, as one line naming its sizes and the kind's."""
        if not self.expected:
            return None
        for sample in batch:
            kind = kind_of(sample, self.padded)
            if kind is None or kind == self.expected:
                continue  # no sample at all: batching.collate names what it is
            fix = "make every sample alike (pad or cut sequences to one length)"
            if not self.padded and isinstance(sample, dict) and kind_of(sample, True) == self.loose:
                fix = ("--set data.pad=always to pad dict samples of 1-D ids in every micro-batch (distrib learnt "
                       "from the data's first samples that their lengths are all one), or pad them yourself")
            return Failed(f"data: a sample of {kind}, where the data's samples are {self.expected}; fix: {fix}")
        return None

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


def probe(split) -> list:
    """Samples spread over a map-style dataset, where dict samples of ids may differ in length (at most PROBE of
    them; just the first of any other kind). A Split is stacked: its samples are of one length."""
    if split is None or isinstance(split, Split):
        return []
    first = split[0]
    if not (isinstance(first, dict) and any(paddable(value) for value in first.values())):
        return [first]
    picks = torch.linspace(0, len(split) - 1, min(len(split), PROBE)).long().unique().tolist()
    many = getattr(split, "__getitems__", None)
    return list(many(picks)) if callable(many) else [split[index] for index in picks]


def with_mask(split: Split) -> Split:
    """A stacked split of dict samples of ids, with the attention_mask (all ones) that padded batches have."""
    inputs = split.inputs
    if not isinstance(inputs, dict) or IDS_KEY not in inputs or MASK_KEY in inputs or inputs[IDS_KEY].dim() != 2:
        return split
    return Split({**inputs, MASK_KEY: torch.ones_like(inputs[IDS_KEY], dtype=torch.long)}, split.targets)


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
