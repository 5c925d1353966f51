"""The user's data: `data.factory = "package.module:function"` called with data.kwargs, or datasets handed to
distrib.fit(); each split becomes an in-memory Split (tensors) or stays a Dataset for the DataLoader path (a Hugging
Face datasets.Dataset read through distrib.data.hf), or stays a stream (an IterableDataset, distrib.data.stream)."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from distrib.data import hf, samples
from distrib.data.tensors import Split, check_inputs
from distrib.errors import UserError

EXPECTED = ("(train, test): two map-style datasets (or lists) of (inputs, targets) or of dicts of tensors, two "
            "(inputs, targets) pairs of tensors (or of dicts of tensors), or a stream (an IterableDataset) for train")
SAMPLE = "(inputs, targets), each a tensor or a dict of tensors (or an int class), or one dict of tensors"


def call_data_factory(spec: str, kwargs: dict) -> tuple[Any, ...]:
    """Imports and calls the factory; anything it raises becomes one line naming it. (train, test), or (train, val,
    test) with a validation set."""
    module_name, _, attr = spec.partition(":")
    where = f"data.factory = {spec!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - the user's module: any failure is theirs to fix
        raise UserError(f"{where}: importing {module_name} raised {_short(e)}; fix the module or PYTHONPATH") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise UserError(f"{where}: {module_name} has no function {attr}; fix data.factory")
    try:
        result = fn(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{where}: calling it with data.kwargs = {kwargs!r} raised {_short(e)}; fix the factory or "
                        "its data.kwargs") from None
    if not (isinstance(result, (tuple, list)) and len(result) in (2, 3)):
        raise UserError(f"{where}: returned {_describe(result)}; fix: make it return {EXPECTED} (or (train, val, "
                        "test) with a validation set)")
    return tuple(result)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value[:4])})"
    return f"a {type(value).__name__}"


class SampleList(Dataset):
    """A Python list or tuple of samples as a map-style dataset."""

    def __init__(self, items):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def _sample_list(value) -> bool:
    """A list or tuple whose items are samples: not an (inputs, targets) pair of batched tensors, which two dicts of
    other keys, or two tensors, are (two dicts of the same keys are two dict samples)."""
    if not isinstance(value, (list, tuple)) or not value or samples.as_pair(value[0]) is None:
        return False
    if len(value) == 2 and all(samples.is_tree(item) for item in value):
        return isinstance(value[0], dict) and isinstance(value[1], dict) and value[0].keys() == value[1].keys()
    return True


def as_split_or_dataset(value, what: str) -> Split | Dataset:
    """A pair of tensors (or dicts of tensors) or a TensorDataset -> a Split; another map-style Dataset stays one (its
    first sample is checked here); anything else is a UserError naming `what`."""
    rows = hf.as_rows(value, what)  # a Hugging Face datasets.Dataset, as it is
    if rows is not None:
        return rows
    if isinstance(value, IterableDataset):  # a stream (distrib.data.stream): checked as it is read
        return value
    if isinstance(value, TensorDataset) and len(value.tensors) == 2:
        value = value.tensors
    if _sample_list(value):  # a list (or tuple) of samples: map-style, as a DataLoader takes it
        value = SampleList(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(samples.is_tree(v) for v in value):
        inputs, targets = value
        check_inputs(what, inputs, targets)
        return Split(samples.detach_cpu(inputs), samples.detach_cpu(targets))
    if isinstance(value, dict) and samples.is_tree(value):  # a tokenized dataset's columns: one dict of tensors
        check_inputs(what, value, value.get(samples.LABELS, next(iter(value.values()))))
        return Split(samples.detach_cpu(value), None)
    if isinstance(value, Dataset) and hasattr(value, "__getitem__") and hasattr(value, "__len__"):
        if len(value) == 0:
            raise UserError(f"{what}: an empty dataset; fix: give at least one sample")
        first = value[0]
        if isinstance(first, dict) and first:
            wrong = next((key for key, item in first.items() if not isinstance(item, torch.Tensor)), None)
            if wrong is not None:
                raise UserError(f"{what}: its samples are dicts whose {wrong!r} is a {type(first[wrong]).__name__}, "
                                "not a tensor; fix: keep only tensor columns (a Hugging Face dataset: "
                                "set_format('torch', columns=[...]))")
        if samples.as_pair(first) is None:
            raise UserError(f"{what}: its samples are {_describe(first)}; fix: make each one {SAMPLE}")
        return value
    raise UserError(f"{what}: {_describe(value)}; fix: give {EXPECTED}")
