"""Hugging Face datasets as they are: a `datasets.Dataset` in any format (torch, numpy, python) read by index, a batch
of rows per read, its columns made tensors as datasets' torch format makes them; `labels` or `label` the targets.
Recognised by its type's module, so `datasets` is never imported here (it is no dependency of distrib)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from distrib.errors import UserError

LABEL_COLUMNS = ("labels", "label")  # the Hugging Face convention first: a dict sample keeps its "labels" inside


def _from_datasets(value) -> bool:
    return type(value).__module__.split(".")[0] == "datasets"


def as_rows(value, what: str) -> HFRows | None:
    """An HFRows over a datasets.Dataset; None for anything not from datasets; one line for its other types."""
    if not _from_datasets(value) or isinstance(value, IterableDataset):  # a streaming one: distrib.data.stream's
        return None
    kind = type(value).__name__
    if kind == "DatasetDict":
        splits = ", ".join(repr(name) for name in value)
        raise UserError(f"{what}: a DatasetDict of the splits {splits}; fix: give one split each, e.g. "
                        "fit(model, dataset['train'], dataset['test'])")
    if not (hasattr(value, "column_names") and hasattr(value, "__getitem__") and hasattr(value, "__len__")):
        raise UserError(f"{what}: a datasets.{kind}, which distrib cannot read; fix: give a datasets.Dataset (or "
                        "a streaming IterableDataset for the training set)")
    return HFRows(value, what)


class HFRows(Dataset):
    """A datasets.Dataset as samples: with a "labels" column, one dict of every tensor column (the Hugging Face
    convention: the dict goes to model(**batch), its labels are the targets); with "label", (inputs, label), the
    inputs the one other column or a dict of the others; with neither, a dict without targets. Columns that are no
    tensors (strings) are dropped, and `note` says so once. A batch is one read of its rows (dataset[indices]), its
    samples then collated as any dataset's (dict samples of different lengths padded, or data.collate)."""

    def __init__(self, dataset, what: str):
        self.dataset, self.what = dataset, what
        if len(dataset) == 0:
            raise UserError(f"{what}: an empty dataset; fix: give at least one sample")
        first = dataset[0]
        if not isinstance(first, dict):
            raise UserError(f"{what}: a datasets.Dataset whose rows are {type(first).__name__}s, not dicts of columns "
                            "(a custom transform?); fix: make each row a dict of columns")
        tensors = {name: to_tensor(value) for name, value in first.items()}
        self.columns = tuple(name for name, tensor in tensors.items() if tensor is not None)
        dropped = [name for name, tensor in tensors.items() if tensor is None]
        if all(name in self.columns for name in LABEL_COLUMNS):
            raise UserError(f"{what}: has both a 'label' and a 'labels' column; fix: keep one, e.g. "
                            "dataset.remove_columns('label')")
        self.label = next((name for name in LABEL_COLUMNS if name in self.columns), None)
        if not [name for name in self.columns if name != self.label]:
            raise UserError(f"{what}: no column besides {self.label or 'none'} holds numbers (columns "
                            f"{list(first)}); fix: tokenize or encode the inputs first, e.g. with dataset.map")
        self.note = f"{what}: a Hugging Face dataset (format {_format(dataset)}): {self._parts()}" + (
            f"; columns {dropped} dropped: they hold no numbers" if dropped else "")

    def _parts(self) -> str:
        if self.label == "label":
            inputs = [name for name in self.columns if name != "label"]
            return f"the targets are its 'label' column, the inputs {inputs[0]!r}" if len(inputs) == 1 else \
                f"the targets are its 'label' column, the inputs a dict of {inputs} (model(**inputs))"
        targets = "its 'labels' the targets" if self.label else "no 'label' or 'labels' column, so no targets"
        return f"samples are dicts of {list(self.columns)} (model(**batch)), {targets}"

    def __len__(self) -> int:
        return len(self.dataset)

    def _sample(self, columns: dict[str, torch.Tensor]):
        if self.label != "label":
            return columns  # a dict sample: its "labels" (if any) are the targets
        inputs = {name: tensor for name, tensor in columns.items() if name != "label"}
        return (next(iter(inputs.values())) if len(inputs) == 1 else inputs), columns["label"]

    def __getitem__(self, index: int):
        row = self.dataset[int(index)]
        return self._sample({name: to_tensor(row[name]) for name in self.columns})

    def __getitems__(self, indices: list[int]) -> list:
        """The rows of a batch from one read (what the DataLoader calls), as samples for its collate function (which
        pads dict samples of different lengths, or is the user's)."""
        batch = self.dataset[list(indices)]
        columns = {name: _rows(batch[name], len(indices)) for name in self.columns}
        return [self._sample({name: rows[row] for name, rows in columns.items()}) for row in range(len(indices))]

    @property
    def targets(self) -> torch.Tensor | None:
        """The targets column alone (for the class count): one column read, not every row's every column."""
        return None if self.label is None else to_tensor(self.dataset[self.label][:])

    @property
    def classes(self) -> list[str] | None:
        """A ClassLabel column's class names."""
        features = getattr(self.dataset, "features", None) or {}
        return getattr(features.get(self.label), "names", None) if self.label else None


def _rows(values, count: int) -> list[torch.Tensor | None]:
    """A batch's column as one tensor per row: unbound from one conversion where the rows have one shape."""
    tensor = to_tensor(values)
    if tensor is not None and tensor.dim() and len(tensor) == count:
        return list(tensor.unbind(0))
    return [to_tensor(value) for value in values]  # rows of different lengths


def _format(dataset) -> str:
    return str(getattr(dataset, "format", {}).get("type") or "python")


def _is_image(value) -> bool:
    return type(value).__module__.startswith("PIL.")


def to_tensor(value) -> torch.Tensor | None:
    """A column's value (one row's, or a batch's) as a tensor, as datasets' torch format makes it: integers int64,
    floats float32, images [C, H, W]; tensors as they are. None for what holds no numbers (strings, None) or rows of
    different shapes."""
    if isinstance(value, torch.Tensor):
        return value
    if _is_image(value):  # a PIL image: [C, H, W] uint8
        array = np.asarray(value)
        array = array[:, :, None] if array.ndim == 2 else array
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))
    if isinstance(value, list) and value and (isinstance(value[0], torch.Tensor) or _is_image(value[0])):
        parts = [to_tensor(item) for item in value]  # a torch-format batch of rows that did not stack, or images
        if any(part is None for part in parts) or len({part.shape for part in parts}) > 1:
            return None
        return torch.stack(parts)
    try:
        array = np.asarray(value)
    except ValueError:  # rows of different lengths
        return None
    if array.dtype.kind in "iu":
        return torch.from_numpy(array.astype(np.int64))
    if array.dtype.kind == "f":
        return torch.from_numpy(array.astype(np.float32))
    if array.dtype.kind == "b":
        return torch.from_numpy(array.copy())
    return None  # strings, None, objects
