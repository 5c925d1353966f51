"""A validation split in process: data.val_fraction holds out the same samples whatever the world size or seed,
evaluations during training are of it (val_*), early stopping watches val_loss, the test set is evaluated once at
the end; a val_* name without a validation set is refused before anything is written; a factory's (train, val, test)
and fit(val_data=...) give one."""

import json

import pytest
import torch

from distrib import fit
from distrib.config import load_config
from distrib.data.split import Subset, held_out
from distrib.errors import UserError
from distrib.training.evaluation import Task
from distrib.worker import run_training
from tests.helpers.data_factories import with_val
from tests.helpers.support import VALIDATED, small_config


def test_held_out_samples_are_fixed_sorted_and_disjoint():
    train, val = held_out(128, 0.1)
    assert len(val) == 13 and len(train) == 115
    assert sorted(torch.cat([train, val]).tolist()) == list(range(128))
    assert torch.equal(held_out(128, 0.1)[1], val) and torch.equal(val, val.sort().values)

    class Source:
        num_samples = 128

        def batches(self, index_lists, epoch=None):
            return iter([(idx, epoch) for idx in index_lists])

    subset = Subset(Source(), val)
    assert subset.num_samples == 13
    assert next(subset.batches([torch.tensor([0, 12])], 4)) == (pytest.approx(val[[0, 12]]), 4)


def test_early_stopping_on_val_loss_and_the_test_set_at_the_end(tmp_path):
    summary = run_training(small_config(tmp_path, *VALIDATED))
    assert summary["stop_reason"] == "early_stop" and summary["steps"] == 9, summary
    assert "val_loss did not improve" in summary["stop_detail"]
    assert summary["val_count"] == 13 and summary["test_count"] == 50
    assert {"val_loss", "val_accuracy", "test_loss", "test_accuracy"} <= summary.keys()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], "val_loss" in r, "test_loss" in r) for r in records if "val_loss" in r or "test_loss" in r]
    assert evals == [(3, True, False), (6, True, False), (9, True, False), (9, False, True)]


def test_val_names_need_a_validation_set_and_a_factory_may_give_one(tmp_path):
    with pytest.raises(UserError, match=r"train.early_stop_metric = 'val_loss': this run reports no val_loss \(val_\* "
                                        r"needs a validation set: data.val_fraction"):
        run_training(small_config(tmp_path / "none", "train.early_stop_metric=val_loss", "train.epochs=1"))
    assert not (tmp_path / "none").exists()
    Task().check_watched("checkpoint.best_metric", "val_accuracy_ema", validation=True)
    with pytest.raises(UserError, match=r"fix: --set checkpoint.best_metric=val_loss"):
        Task("values").check_watched("checkpoint.best_metric", "val_accuracy", validation=True)
    summary = run_training(small_config(tmp_path / "three", "data.factory=tests.helpers.data_factories:with_val",
                                        "train.max_steps=2"))
    assert summary["val_count"] == 10 and summary["test_count"] == 20
    with pytest.raises(UserError, match=r"data.val_fraction = 0.5: the data has a validation set of its own"):
        run_training(small_config(tmp_path / "both", "data.factory=tests.helpers.data_factories:with_val",
                                  "data.val_fraction=0.5"))
    with pytest.raises(Exception, match=r"data.val_fraction = 1.0: must be in \[0, 1\)"):
        load_config(None, ["data.val_fraction=1.0"])


def test_fit_takes_val_data(tmp_path):
    train, val, test = with_val()
    summary = fit(lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)), train, test,
                  val_data=val, overrides={"train.max_steps": 4, "train.epochs": 0, "train.global_batch_size": 16,
                                           "checkpoint.keep_best": 1, "checkpoint.best_metric": "val_accuracy",
                                           "run.progress": False, "dist.device": "cpu", "run.dir": str(tmp_path)})
    assert summary["val_count"] == 10 and summary["test_count"] == 20
    assert summary["best_checkpoints"][0]["value"] == summary["val_accuracy"]  # ranked by the validation set
