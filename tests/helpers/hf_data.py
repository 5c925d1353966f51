"""Hugging Face datasets for the tests, built with datasets.Dataset.from_dict (no download): 3x6x6 float images in 3
classes plus a text column, split by train_test_split. `data.factory = "tests.helpers.hf_data:splits"` too."""

from __future__ import annotations

import numpy as np
import torch.nn as nn


def columns(num_samples: int = 320, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 3, num_samples)
    image = rng.normal(size=(num_samples, 3, 6, 6)).astype(np.float32) + label[:, None, None, None]
    return {"image": image.tolist(), "label": label.tolist(), "caption": [f"sample {i}" for i in range(num_samples)]}


def splits(format: str | None = "torch", label: str = "label", num_samples: int = 320):
    """(train, test) datasets.Dataset in `format`; label="labels" names the targets column the other way."""
    import datasets

    data = columns(num_samples)
    data[label] = data.pop("label")
    split = datasets.Dataset.from_dict(data).with_format(format).train_test_split(test_size=64, seed=0)
    return split["train"], split["test"]


class Classifier(nn.Module):
    """model(image) -> logits, or model(image=..., labels=...) for dict samples (labels unused: distrib's loss)."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 16), nn.ReLU(), nn.Linear(16, num_classes))

    def forward(self, image, labels=None):
        return self.net(image)


def classifier(num_classes: int) -> nn.Module:
    return Classifier(num_classes)
