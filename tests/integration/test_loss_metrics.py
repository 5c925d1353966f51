"""Loss and metrics: the user's loss function against the built-in one, exact evaluation against a hand-computed
reference (test loss of the training loss, top-1, top-5, per class), and the BatchNorm note."""

import pytest
import torch

from distrib import cli
from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.support import SMALL, load_weights, sets
from tests.helpers.user_package import write_user_package

SYNTHETIC = [*SMALL, "train.max_steps=8"]


@pytest.mark.timeout(900)
def test_a_loss_function_by_name_trains_like_the_built_in_key(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_user_package(tmp_path / "outside")))
    by_key = run_training(load_config(None, [*SYNTHETIC, f"run.dir={tmp_path}/key", "train.label_smoothing=0.2"]))
    by_function = run_training(load_config(None, [*SYNTHETIC, f"run.dir={tmp_path}/fn",
                                                   "train.loss=userpkg.losses:smoothed"]))
    plain = run_training(load_config(None, [*SYNTHETIC, f"run.dir={tmp_path}/plain"]))
    key, function = load_weights(tmp_path / "key"), load_weights(tmp_path / "fn")
    assert all(torch.equal(key[name], function[name]) for name in key)  # the same loss, bit for bit
    assert not torch.equal(key["out.weight"], load_weights(tmp_path / "plain")["out.weight"])
    # Evaluation: per sample for the built-in, batch mean x count for a function: the same up to rounding.
    assert by_function["test_loss"] == pytest.approx(by_key["test_loss"], rel=1e-6)
    assert by_function["test_loss"] > plain["test_loss"]  # smoothing raises the loss of confident predictions


@pytest.mark.timeout(900)
def test_a_batchnorm_model_says_once_that_world_sizes_no_longer_agree(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(write_user_package(tmp_path / "outside")))
    argv = ["train", *sets(*SMALL, "data.factory=userpkg.data:cifar100_like", "data.num_classes=100",
                           "data.kwargs={num_train = 32, num_test = 8}", "model.factory=userpkg.models:with_batchnorm",
                           "train.max_steps=1", "train.global_batch_size=16", f"run.dir={tmp_path}/run")]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("BatchNorm layers") == 1 and "per micro-batch" in err and "dist.sync_batchnorm=true" in err
