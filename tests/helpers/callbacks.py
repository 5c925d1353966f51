"""Callbacks and a fine-tuning model for the callback tests: `train.callbacks = ["tests.helpers.callbacks:NAME"]`, or
instances given to fit(callbacks=...)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


class FreezeBatchNorm:
    """The recipe of docs/training-features.md, Callbacks: BatchNorm layers whose parameters are all frozen run in eval
    mode (their running statistics used, never updated), as a fine-tune of a pretrained backbone wants."""

    def on_train_start(self, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and not any(
                    p.requires_grad for p in module.parameters()):
                module.eval()


class HookLog:
    """Writes every hook call to path as JSON lines (the step, the loss on log steps, the metrics' test_count), with
    whether the frozen BatchNorm layers were in train mode at that moment."""

    def __init__(self, path: Path, log_every: int):
        self.path, self.log_every, self.model = Path(path), log_every, None

    def _write(self, **record) -> None:
        if self.model is not None:
            record["bn_training"] = [m.training for m in self.model.modules() if isinstance(m, nn.BatchNorm2d)]
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_start(self, model: nn.Module) -> None:
        self.model = model
        self._write(hook="on_train_start", rank=dist.get_rank() if dist.is_initialized() else 0)

    def on_step_end(self, step: int, loss: torch.Tensor) -> None:
        self._write(hook="on_step_end", step=step, loss=loss.item() if step % self.log_every == 0 else None)

    def on_evaluate(self, step: int, metrics: dict) -> None:
        self._write(hook="on_evaluate", step=step, test_count=metrics["test_count"], test_loss=metrics["test_loss"])

    def on_train_end(self, summary: dict) -> None:
        self._write(hook="on_train_end", steps=summary["steps"])


class RaisesAtStep2:
    def on_step_end(self, step: int, loss) -> None:
        if step == 2:
            raise ValueError(f"no good at step {step}\nsecond line")


class Misspelled:
    def on_train_begin(self, model) -> None:  # the Hugging Face Trainer's name
        pass


class FineTuneNet(nn.Module):
    """A 'pretrained' conv + BatchNorm backbone (frozen, its running statistics set as a pretraining would leave
    them) and a trainable head without BatchNorm."""

    def __init__(self, num_classes: int, in_channels: int, width: int = 8):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.head = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(width, num_classes))
        g = torch.Generator().manual_seed(11)
        for module in self.backbone:
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.copy_(torch.randn(width, generator=g) * 0.1)
                module.running_var.copy_(torch.rand(width, generator=g) * 0.5 + 0.75)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.head(self.backbone(x))


def fine_tune_net(num_classes: int, in_channels: int) -> nn.Module:
    return FineTuneNet(num_classes, in_channels)


def fine_tune_data(num_train: int = 256, num_test: int = 64):
    """(train, test) pairs of 3x8x8 float images in 4 classes, learnable (a per-class offset)."""
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 4, (num_train + num_test,), generator=g)
    images = torch.randn(num_train + num_test, 3, 8, 8, generator=g) + 0.5 * labels[:, None, None, None]
    return (images[:num_train], labels[:num_train]), (images[num_train:], labels[num_train:])
