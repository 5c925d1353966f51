"""A user's own code, written OUTSIDE the project (into a temp dir that the test puts on PYTHONPATH): a data factory of
3x32x32 samples in 100 classes, a small ResNet-style model factory, a loss, and factories that are wrong on purpose."""

from __future__ import annotations

import textwrap
from pathlib import Path

DATA = '''
import torch


def cifar100_like(num_train=512, num_test=200, num_classes=100, label_offset=0):
    """(train, test) tensor pairs: per-class prototypes plus noise, 3x32x32 floats, labels 0..num_classes-1."""
    g = torch.Generator().manual_seed(7)
    prototypes = torch.randn(num_classes, 3, 32, 32, generator=g)

    def split(n):
        labels = torch.randint(0, num_classes, (n,), generator=g)
        return prototypes[labels] + torch.randn(n, 3, 32, 32, generator=g), labels + label_offset

    return split(num_train), split(num_test)


def bad_labels(**kwargs):
    """Labels -1..98: one class index below range."""
    return cifar100_like(label_offset=-1, **kwargs)
'''

MODELS = '''
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A basic residual block. GroupNorm, not BatchNorm: BatchNorm's statistics are per micro-batch, so its results
    change with the world size, and the tests compare world sizes."""

    def __init__(self, channels_in, channels_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(4, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(4, channels_out)
        self.skip = (nn.Sequential() if stride == 1 and channels_in == channels_out
                     else nn.Conv2d(channels_in, channels_out, 1, stride, bias=False))

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.skip(x))


class SmallResNet(nn.Module):
    def __init__(self, num_classes, in_channels, width=8):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.layers = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        x = self.layers(F.relu(self.stem(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet(num_classes, in_channels, image_size, width=8):
    assert image_size == 32, image_size
    return SmallResNet(num_classes, in_channels, width)


def ten_classes(in_channels):
    """Ignores num_classes: always 10 logits."""
    return SmallResNet(10, in_channels)


def with_batchnorm(num_classes, in_channels):
    model = SmallResNet(num_classes, in_channels)
    model.stem = nn.Sequential(model.stem, nn.BatchNorm2d(8))
    return model


def raises():
    raise RuntimeError("out of coffee")


def no_parameters():
    return nn.Sequential(nn.Flatten())
'''

LOSSES = '''
import torch.nn.functional as F


def smoothed(outputs, targets):
    return F.cross_entropy(outputs, targets, label_smoothing=0.2)
'''

BROKEN = '''
raise ValueError("broken at import")
'''


def write_user_package(root: Path) -> Path:
    """root/userpkg/{data,models,losses,broken}.py; returns root, for PYTHONPATH."""
    package = Path(root) / "userpkg"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    for name, text in (("data", DATA), ("models", MODELS), ("losses", LOSSES), ("broken", BROKEN)):
        (package / f"{name}.py").write_text(textwrap.dedent(text).lstrip())
    return Path(root)
