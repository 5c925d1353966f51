"""Loss and metrics: the user's loss function against the built-in one, exact evaluation against a hand-computed
reference (test loss of the training loss, top-1, top-5, per class), and the BatchNorm note."""

import pytest
import torch
import torch.nn.functional as F
from support import SMALL, load_weights, sets
from user_package import write_user_package

from distrib import cli
from distrib.config import load_config
from distrib.data import load_data
from distrib.distributed.runtime import open_runtime
from distrib.errors import ConfigError
from distrib.models.network import Network
from distrib.training.evaluation import evaluate
from distrib.training.losses import cross_entropy
from distrib.worker import run_training

SYNTHETIC = [*SMALL, "train.max_steps=8"]


@pytest.mark.timeout(120)
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


@pytest.mark.parametrize("override, message", [
    ("train.loss=focal", "train.loss = 'focal': must be cross_entropy, mse, l1, bce_with_logits or package.module"),
    ("train.label_smoothing=1.0", "train.label_smoothing = 1.0: must be in [0, 1)"),
    ("dist.sync_batchnorm=1", "dist.sync_batchnorm = 1: must be of type bool"),
    ("model.kwargs=3", "model.kwargs = 3: must be a table"),
])
def test_new_keys_are_validated(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.timeout(60)
def test_evaluation_matches_a_hand_computed_reference():
    config = load_config(None, ["data.name=synthetic", "data.num_classes=12", "data.synthetic_test_size=301",
                                "dist.device=cpu"])
    loss = cross_entropy(label_smoothing=0.1)
    with open_runtime(config.dist) as runtime:
        data = load_data(config.data, runtime, seed=0)
        torch.manual_seed(0)
        model = Network(num_classes=12)
        metrics = evaluate(model, data.test, 12, 50, runtime, loss, class_names=data.info.class_names)
        inputs, targets = next(data.test.batches([torch.arange(data.test.num_samples)]))
    with torch.no_grad():
        logits = model(inputs)
    assert metrics["test_count"] == 301
    expected_loss = F.cross_entropy(logits, targets, label_smoothing=0.1, reduction="none").double().mean()
    assert metrics["test_loss"] == pytest.approx(expected_loss.item(), rel=1e-6)
    assert metrics["test_accuracy"] == (logits.argmax(1) == targets).sum().item() / 301
    top5 = (logits.topk(5, dim=1).indices == targets[:, None]).any(dim=1)
    assert metrics["test_top5_accuracy"] == top5.sum().item() / 301 > metrics["test_accuracy"]
    per_class = metrics["test_per_class_accuracy"]
    assert list(per_class) == list(data.info.class_names) and len(per_class) == 12
    for label, name in enumerate(data.info.class_names):
        mine = targets == label
        right = (logits.argmax(1)[mine] == label).sum().item()
        assert per_class[name] == (right / mine.sum().item() if mine.any() else None), name


def test_few_classes_have_no_top5(tmp_path):
    config = load_config(None, ["data.name=synthetic", "data.num_classes=5", "data.synthetic_test_size=40",
                                "dist.device=cpu"])
    with open_runtime(config.dist) as runtime:
        data = load_data(config.data, runtime, seed=0)
        metrics = evaluate(Network(num_classes=5), data.test, 5, 16, runtime)
    assert "test_top5_accuracy" not in metrics and len(metrics["test_per_class_accuracy"]) == 5


@pytest.mark.timeout(120)
def test_a_batchnorm_model_says_once_that_world_sizes_no_longer_agree(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(write_user_package(tmp_path / "outside")))
    argv = ["train", *sets(*SMALL, "data.factory=userpkg.data:cifar100_like", "data.num_classes=100",
                           "data.kwargs={num_train = 32, num_test = 8}", "model.factory=userpkg.models:with_batchnorm",
                           "train.max_steps=1", "train.global_batch_size=16", f"run.dir={tmp_path}/run")]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("BatchNorm layers") == 1 and "per micro-batch" in err and "dist.sync_batchnorm=true" in err
