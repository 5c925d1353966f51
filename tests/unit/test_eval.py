"""Exact distributed evaluation: every test sample once, no padding; world sizes 1, 2, 3 give identical metrics."""


from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distrib.config import DistConfig
from distrib.data import eval_batches, samples
from distrib.data.batching import DeviceBatches
from distrib.data.tensors import Split
from distrib.distributed.runtime import open_runtime
from distrib.training.evaluation import evaluate, task_of, user_metric
from distrib.training.losses import Loss, forward, logits_of, model_loss


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_eval_shards_cover_every_sample_once(world_size):
    shards = [eval_batches(1003, 100, rank, world_size) for rank in range(world_size)]
    seen = [int(i) for shard in shards for batch in shard for i in batch]
    assert sorted(seen) == list(range(1003))  # no padding, no duplicates, uneven shards allowed


class _Heads(nn.Module):
    """A linear layer whose [B, 4 + 1] output is returned in one of the structures a model may return."""

    def __init__(self, structure: str):
        super().__init__()
        self.structure = structure
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 5)

    def forward(self, x, labels=None):
        out = self.linear(x)
        cls, reg = out[:, :4], out[:, 4:]
        if self.structure == "tuple":
            return cls, reg
        if self.structure == "dict":
            return {"cls": cls, "reg": reg}
        if self.structure == "object":  # a Hugging Face ModelOutput: its own loss (a batch mean) and its logits
            return SimpleNamespace(logits=cls, loss=F.cross_entropy(cls, labels))
        return cls


def _mean_loss(outputs, targets):
    """Cross-entropy of the class head, plus the mse of the value head where there is one: a mean over samples."""
    if isinstance(outputs, dict):
        outputs = outputs["cls"], outputs["reg"]
    cls, reg = outputs if isinstance(outputs, tuple) else (outputs, None)
    labels, values = (targets["label"], targets["value"]) if isinstance(targets, dict) else (targets, None)
    loss = F.cross_entropy(cls, labels)
    return loss + F.mse_loss(reg.squeeze(1), values) if reg is not None and values is not None else loss


def _right(outputs, targets):
    if isinstance(outputs, (dict, tuple)):
        outputs = outputs["cls"] if isinstance(outputs, dict) else outputs[0]
    right = outputs.argmax(1) == (targets["label"] if isinstance(targets, dict) else targets)
    return {"right": (right.sum(), right.numel())}


@pytest.mark.parametrize("structure, targets_kind", [("tensor", "tensor"), ("tensor", "dict"), ("tuple", "tensor"),
                                                     ("dict", "dict"), ("object", "labels")])
def test_every_output_structure_counts_its_samples_and_weights_the_loss_by_them(structure, targets_kind):
    """100 samples in eval batches of 30 (the last of 10): the count and the sample-weighted mean loss of a tensor,
    a tuple, a dict (whose len() is 2) and an object with .logits and .loss (dict samples, the labels inside)."""
    g = torch.Generator().manual_seed(1)
    x, labels, values = torch.randn(100, 3, generator=g), torch.randint(0, 4, (100,), generator=g), torch.randn(100)
    inputs, targets = x, {"tensor": labels, "dict": {"label": labels, "value": values}, "labels": None}[targets_kind]
    if targets_kind == "labels":
        inputs, targets = {"x": x, "labels": labels}, None
    model, loss = _Heads(structure), model_loss() if structure == "object" else Loss("user", _mean_loss)
    with open_runtime(DistConfig(device="cpu")) as runtime:
        source = DeviceBatches(Split(inputs, targets), runtime)
        dry_inputs, dry_targets = next(source.batches([torch.arange(2)]))
        with torch.no_grad():
            dry_outputs = forward(model, dry_inputs)
        metric = user_metric("right", _right, dry_outputs, dry_targets)
        metrics = evaluate(model, source, 4, 30, runtime, loss, task=task_of(dry_outputs, dry_targets, loss, (metric,)))
        all_inputs, all_targets = next(source.batches([torch.arange(100)]))
    with torch.no_grad():
        outputs = forward(model, all_inputs)
    assert metrics["test_count"] == 100
    assert metrics["test_loss"] == pytest.approx(loss(outputs, all_targets).item(), rel=1e-5)  # the mean of all 100
    assert metrics["test_right"] == _right(logits_of(outputs), all_targets)["right"][0].item() / 100


def test_a_batchs_samples_are_counted_in_its_targets_or_inputs_of_any_structure():
    ids, labels = torch.zeros(6, 4, dtype=torch.long), torch.zeros(6)
    assert samples.num_samples(labels, {"a": ids}) == 6
    assert samples.num_samples({"label": labels, "value": labels}) == 6  # not 2, its number of keys
    assert samples.num_samples(None, {"input_ids": ids, "attention_mask": ids}) == 6
    assert samples.num_samples((labels, labels[:, None])) == 6
    assert samples.num_samples(torch.tensor(1.0), ids) == 6  # a 0-dim tensor has no sample dimension
