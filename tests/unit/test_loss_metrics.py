"""Loss and metrics: the user's loss function against the built-in one, exact evaluation against a hand-computed
reference (test loss of the training loss, top-1, top-5, per class), and the BatchNorm note."""

import pytest
import torch
import torch.nn.functional as F

from distrib.config import load_config
from distrib.data import load_data
from distrib.distributed.runtime import open_runtime
from distrib.errors import ConfigError
from distrib.models.network import Network
from distrib.training.evaluation import evaluate
from distrib.training.losses import cross_entropy


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
