"""The seed lesson's Fashion-MNIST CNN, a plain nn.Module that knows nothing of ranks or devices."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

NETWORK_INPUT = (1, 28, 28)


class Network(nn.Module):
    """The seed lesson's Fashion-MNIST CNN: two 5x5 convs with 2x2 max-pool, then 192 -> 120 -> 60 -> num_classes."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels=1, out_channels=6, kernel_size=5)
        self.conv2 = nn.Conv2d(in_channels=6, out_channels=12, kernel_size=5)
        self.fc1 = nn.Linear(in_features=12 * 4 * 4, out_features=120)
        self.fc2 = nn.Linear(in_features=120, out_features=60)
        self.out = nn.Linear(in_features=60, out_features=num_classes)

    def forward(self, t):
        t = F.max_pool2d(F.relu(self.conv1(t)), kernel_size=2, stride=2)
        t = F.max_pool2d(F.relu(self.conv2(t)), kernel_size=2, stride=2)
        t = t.flatten(start_dim=1)
        t = F.relu(self.fc1(t))
        t = F.relu(self.fc2(t))
        return self.out(t)
