"""Model factories for tests: `model.factory = tests.helpers.factories:NAME` (the repository root is on sys.path in
the test runs)."""

import torch
import torch.nn as nn

from distrib.models.network import Network


def network():
    return Network()


def meta_parameter():
    """A factory that forgot to materialise one parameter: it stays on the meta device."""
    model = Network()
    model.scale = nn.Parameter(torch.ones(10, device="meta"))
    return model


class _PinnedBuffer(Network):
    """Re-creates a buffer on the meta device after every .to(): registered, yet never where the model is."""

    def __init__(self):
        super().__init__()
        self.register_buffer("offset", torch.zeros(10))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.offset = torch.zeros(10, device="meta")
        return self


def pinned_buffer():
    return _PinnedBuffer()


class _ForwardMakesMeta(Network):
    def forward(self, t):
        return super().forward(t) + torch.zeros(10, device="meta")  # a tensor made in forward, on another device


def forward_makes_meta():
    return _ForwardMakesMeta()


def not_a_module():
    return "not a model"


class _NanGradInOneShard(Network):
    """A finite forward whose gradient is NaN in the second element of `probe` only: d/dp sqrt(p - p) = inf - inf.
    Under fsdp at world size 2, rank 1 holds that element and rank 0 the finite one."""

    def __init__(self):
        super().__init__()
        self.probe = nn.Parameter(torch.ones(2))

    def forward(self, t):
        return super().forward(t) + torch.sqrt(self.probe[1] - self.probe[1])


def nan_grad_in_one_shard():
    return _NanGradInOneShard()


def wide_mlp(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, width: int = 512):
    """A wide two-layer MLP: most of its parameters in two large matrices, sharded in rows by fsdp and hsdp."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, width), nn.ReLU(),
                         nn.Linear(width, num_classes))
