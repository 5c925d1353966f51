"""The training loss: cross-entropy (with label smoothing) or the user's `(outputs, targets) -> scalar` function, and
its per-sample form for exact evaluation sums."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from distrib.config import TrainConfig
from distrib.factory import import_object

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Loss:
    """A batch-mean loss. `per_sample` gives one value per sample where the loss has that form (cross-entropy);
    for a user's function it is None and evaluation weights each fixed evaluation batch's mean by its size."""

    def __init__(self, name: str, batch_mean: LossFn, per_sample: LossFn | None = None):
        self.name = name
        self.batch_mean = batch_mean
        self.per_sample = per_sample

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.batch_mean(outputs, targets)


def cross_entropy(label_smoothing: float = 0.0) -> Loss:
    def batch_mean(outputs, targets):
        return F.cross_entropy(outputs, targets, label_smoothing=label_smoothing)

    def per_sample(outputs, targets):
        return F.cross_entropy(outputs, targets, reduction="none", label_smoothing=label_smoothing)

    return Loss("cross_entropy", batch_mean, per_sample)


def build_loss(config: TrainConfig, loss_fn: LossFn | None = None) -> Loss:
    """train.loss (or, from distrib.fit, a function given in Python, which wins)."""
    if loss_fn is not None:
        return Loss(getattr(loss_fn, "__name__", type(loss_fn).__name__), loss_fn)
    if config.loss == "cross_entropy":
        return cross_entropy(config.label_smoothing)
    return Loss(config.loss, import_object("train.loss", config.loss))
