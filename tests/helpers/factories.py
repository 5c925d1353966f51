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


class _SelfInitialising(nn.Module):
    """A user's model with its own reset_parameters() that writes every parameter and buffer (a normal, a
    layer's own reset, a constant buffer): sharded runs initialise its shards without building it whole."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Linear(28 * 28, 48)
        self.head = nn.Linear(48, num_classes)
        self.register_buffer("scale", torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.body.weight, std=0.05)
        nn.init.zeros_(self.body.bias)
        self.head.reset_parameters()
        self.scale.fill_(0.5)

    def forward(self, t):
        return self.head(torch.relu(self.body(t.flatten(1)))) * self.scale


def self_initialising(num_classes: int = 10):
    return _SelfInitialising(num_classes)


def wide_mlp(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, width: int = 512):
    """A wide two-layer MLP: most of its parameters in two large matrices, sharded in rows by fsdp and hsdp."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, width), nn.ReLU(),
                         nn.Linear(width, num_classes))


@torch.library.custom_op("distrib_tests::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # registered without a fake (meta) implementation: torch.compile cannot trace it


class _Untraceable(nn.Module):
    """A layer that calls a custom op with no fake implementation (as a C++ extension's op may be)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.linear = nn.Linear(28 * 28, num_classes)

    def forward(self, t):
        return _doubled(self.linear(t.flatten(1)))


def untraceable(num_classes: int = 10):
    """A model whose one block (dist.shard_modules = auto finds the layer) dynamo cannot trace."""
    return nn.Sequential(_Untraceable(num_classes))
