"""A model other than the seed Network, for checkpoints that do not fit:
`model.factory=tests.helpers.other_models:linear`."""

import torch.nn as nn


def linear():
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
