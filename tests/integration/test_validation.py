"""A validation split across world sizes: data.val_fraction = 0.1 at world size 2 holds out the samples world size 1
holds out, early stopping on val_loss stops both at the same step, and val_loss sits beside test_loss in both
summaries."""

import json

import pytest

from distrib.worker import run_training
from tests.helpers.processes import EVENT_S
from tests.helpers.support import SMALL, VALIDATED, assert_ok, sets, small_config, torchrun_train


@pytest.mark.timeout(600)
def test_val_fraction_and_early_stopping_on_val_loss_agree_at_world_sizes_1_and_2(tmp_path):
    one = run_training(small_config(tmp_path / "one", *VALIDATED))
    assert_ok(torchrun_train(2, *sets(*SMALL, *VALIDATED, f"run.dir={tmp_path}/two"), timeout=EVENT_S))
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    for summary in (one, two):
        assert summary["stop_reason"] == "early_stop" and summary["steps"] == 9, summary
        assert summary["val_count"] == 13 and summary["test_count"] == 50
    for key in ("val_loss", "val_accuracy", "test_loss", "test_accuracy"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
