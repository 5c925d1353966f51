"""Models are plain nn.Modules that know nothing of ranks or devices: the seed Network and user factories.

A factory is `package.module:function`, called with no arguments, returning an nn.Module for 1x28x28 inputs."""

from __future__ import annotations

import importlib

import torch.nn as nn
import torch.nn.functional as F

from distrib.config import ModelConfig
from distrib.errors import ConfigError


class Network(nn.Module):
    """The seed lesson's Fashion-MNIST CNN: two 5x5 convs with 2x2 max-pool, then 192 -> 120 -> 60 -> 10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels=1, out_channels=6, kernel_size=5)
        self.conv2 = nn.Conv2d(in_channels=6, out_channels=12, kernel_size=5)
        self.fc1 = nn.Linear(in_features=12 * 4 * 4, out_features=120)
        self.fc2 = nn.Linear(in_features=120, out_features=60)
        self.out = nn.Linear(in_features=60, out_features=10)

    def forward(self, t):
        t = F.max_pool2d(F.relu(self.conv1(t)), kernel_size=2, stride=2)
        t = F.max_pool2d(F.relu(self.conv2(t)), kernel_size=2, stride=2)
        t = t.flatten(start_dim=1)
        t = F.relu(self.fc1(t))
        t = F.relu(self.fc2(t))
        return self.out(t)


_BUILTIN = {"network": Network}


def _import_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"model.factory = {spec!r}: cannot import {module_name!r} ({e}); "
                          "check the module path and that its package is on PYTHONPATH") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"model.factory = {spec!r}: {module_name!r} has no {attr!r}; "
                              "name a function that returns an nn.Module")
    if not callable(obj):
        raise ConfigError(f"model.factory = {spec!r}: {attr!r} is not callable; name a function")
    return obj


def build_model(config: ModelConfig) -> nn.Module:
    """A fresh model on whatever device its constructor chose (normally the CPU); placement comes later."""
    factory = _import_factory(config.factory) if config.factory else _BUILTIN[config.name]
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory = {config.factory!r}: returned {type(model).__name__}, not an nn.Module; "
                          "return the model from the factory")
    return model
