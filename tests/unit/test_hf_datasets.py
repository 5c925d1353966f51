"""Hugging Face datasets as they are, in one process: the torch, numpy and python formats give the same tensors and
the same training, read a batch of rows at a time (never every column of every row); `label` and `labels` name the
targets (the log says which); a data.factory may return them; what cannot be read is one line."""

import datasets
import numpy as np
import pytest
import torch

from distrib import fit
from distrib.config import DataConfig
from distrib.data.collate import collate_for
from distrib.data.factory import as_split_or_dataset
from distrib.data.hf import HFRows
from distrib.data.load import load_data
from distrib.errors import UserError
from tests.helpers import hf_data
from tests.helpers.fit_hooks_and_hf import HF_OVERRIDES
from tests.helpers.support import load_weights
from tests.unit.test_datasets import CPU

OVERRIDES = {**HF_OVERRIDES, "train.max_steps": 6}


@pytest.fixture
def reads(monkeypatch) -> list:
    """Every datasets.Dataset read: (key, the columns of the dataset read)."""
    seen, original = [], datasets.Dataset.__getitem__

    def getitem(self, key):
        seen.append((key, tuple(self.column_names)))
        return original(self, key)

    monkeypatch.setattr(datasets.Dataset, "__getitem__", getitem)
    return seen


def _batch(rows: HFRows, indices: list[int]):
    """What the DataLoader makes of these rows: one read, then distrib's collate (the data's kind learnt from them)."""
    batch = rows.__getitems__(indices)
    return collate_for(0).learnt(batch)(batch)


def test_every_format_gives_the_same_tensors():
    batches = []
    for format in ("torch", "numpy", None):
        rows = as_split_or_dataset(hf_data.splits(format)[0], "train data")
        assert isinstance(rows, HFRows)
        inputs, targets = _batch(rows, [0, 5, 2])
        assert inputs.dtype == torch.float32 and inputs.shape == (3, 3, 6, 6)
        assert targets.dtype == torch.int64 and targets.shape == (3,)
        assert torch.equal(rows[5][0], inputs[1]) and torch.equal(rows[5][1], targets[1])
        assert torch.equal(rows.targets, torch.stack([rows[i][1] for i in range(len(rows))]))
        batches.append((inputs, targets))
    assert all(torch.equal(a, b) for batch in batches[1:] for a, b in zip(batch, batches[0]))


@pytest.mark.timeout(300)
def test_every_format_trains_alike_reading_rows_not_columns(tmp_path, reads, capsys):
    for format in ("torch", "numpy", None):
        train, test = hf_data.splits(format, num_samples=640)
        summary = fit(hf_data.classifier, train, test, overrides={**OVERRIDES, "run.dir": str(tmp_path / str(format))})
        assert summary["test_count"] == 64 and summary["data"]["num_classes"] == 3
    weights = [load_weights(tmp_path / str(format)) for format in ("torch", "numpy", None)]
    assert all(torch.equal(w[name], weights[0][name]) for w in weights[1:] for name in weights[0])
    # Rows by index (an int, or a list of a batch's indices); a slice only of the one targets column.
    for key, columns in reads:
        assert isinstance(key, (int, list, str)) or (isinstance(key, slice) and columns == ("label",)), key
    # At most a batch of rows: the statistics of data.normalize = auto are read 256 rows at a time.
    assert max(len(key) for key, _ in reads if isinstance(key, list)) == 256 < len(train)
    said = [line for line in capsys.readouterr().err.splitlines() if "Hugging Face" in line]
    assert said == [f"[distrib] train data: a Hugging Face dataset (format {format}): the targets are its 'label' "
                    "column, the inputs 'image'; columns ['caption'] dropped: they hold no numbers"
                    for format in ("torch", "numpy", "python")]


@pytest.mark.timeout(300)
def test_label_and_labels_train_alike_and_the_log_says_which(tmp_path, capsys):
    overrides = {**OVERRIDES, "data.normalize": "none"}  # auto would normalise the image tensor, not the dict's
    fit(hf_data.classifier, *hf_data.splits("torch", "label"), overrides={**overrides, "run.dir": str(tmp_path / "a")})
    fit(hf_data.classifier, *hf_data.splits("torch", "labels"), overrides={**overrides, "run.dir": str(tmp_path / "b")})
    a, b = load_weights(tmp_path / "a"), load_weights(tmp_path / "b")
    assert all(torch.equal(a[name], b[name]) for name in a)
    said = [line for line in capsys.readouterr().err.splitlines() if "Hugging Face" in line]
    assert "the targets are its 'label' column, the inputs 'image'" in said[0]
    assert "samples are dicts of ['image', 'labels'] (model(**batch)), its 'labels' the targets" in said[1]


def test_a_data_factory_may_return_hugging_face_datasets():
    said = []
    config = DataConfig(factory="tests.helpers.hf_data:splits", kwargs={"format": "numpy", "num_samples": 96},
                        normalize="none")
    data = load_data(config, CPU, seed=0, log=said.append)
    assert data.train.num_samples == 32 and data.test.num_samples == 64 and data.info.num_classes == 3
    inputs, targets = next(data.train.batches([torch.tensor([3, 1])]))
    rows = as_split_or_dataset(hf_data.splits("numpy", num_samples=96)[0], "train data")
    assert torch.equal(inputs, torch.stack([rows[3][0], rows[1][0]]))
    assert torch.equal(targets, torch.stack([rows[3][1], rows[1][1]]))
    assert said[0].startswith("data.factory = 'tests.helpers.hf_data:splits': train: a Hugging Face dataset")


@pytest.mark.parametrize("make, match", [
    (lambda: datasets.Dataset.from_dict({"x": [[1.0]] * 4, "label": [0] * 4, "labels": [0] * 4}),
     r"^train data: has both a 'label' and a 'labels' column; fix: keep one"),
    (lambda: datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [1]})}),
     r"^train data: a DatasetDict of the splits 'train'; fix: give one split each"),
    (lambda: datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}),
     r"^train data: no column besides label holds numbers \(columns \['text', 'label'\]\); fix: tokenize"),
    (lambda: datasets.Dataset.from_dict({"x": [1.0]}).select([]),
     r"^train data: an empty dataset"),
])
def test_what_cannot_be_read_is_one_line(make, match):
    with pytest.raises(UserError, match=match):
        as_split_or_dataset(make(), "train data")


def test_rows_of_different_lengths_are_padded_as_dict_samples_and_one_line_as_pairs():
    ragged = {"input_ids": [[1, 2], [1, 2, 3]], "labels": [[2, 3], [2, 3, 4]]}
    rows = as_split_or_dataset(datasets.Dataset.from_dict(ragged).with_format("torch"), "train data")
    inputs, targets = _batch(rows, [0, 1])
    assert inputs["input_ids"].tolist() == [[1, 2, 0], [1, 2, 3]] and inputs["labels"].tolist() == [[2, 3, -100],
                                                                                                     [2, 3, 4]]
    pairs = as_split_or_dataset(datasets.Dataset.from_dict({"input_ids": ragged["input_ids"], "label": [0, 1]}),
                                "train data")
    assert "samples of different shapes or types in one batch" in _batch(pairs, [0, 1]).message
    assert np.array_equal(pairs[1][0].numpy(), [1, 2, 3])
