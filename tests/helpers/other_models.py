"""A model other than the seed Network, for checkpoints that do not fit:
`model.factory=tests.helpers.other_models:linear`."""

import torch.nn as nn


def linear():
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def conv_batchnorm(num_classes: int = 10, in_channels: int = 1):
    """A tiny conv + BatchNorm model (as ResNets are built): under fsdp + bf16 its norm layers must stay fp32."""
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, num_classes))
