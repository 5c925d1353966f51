"""The strategy objects in one process: the registry and the mesh each gets, which models initialise their own shards
(checked on the meta device), and the sharded build at world size 1 giving bitwise the weights one process builds."""

import pytest
import torch
import torch.nn as nn

from distrib.config import DistConfig
from distrib.distributed.mesh import MeshShape
from distrib.distributed.runtime import open_runtime
from distrib.distributed.strategies import Build, DDPStrategy, FSDPStrategy, make_strategy
from distrib.distributed.strategies.materialise import build_on_meta, build_whole, initialises_itself
from distrib.models.gpt import GPT
from distrib.models.network import Network
from tests.helpers.factories import self_initialising


def test_every_strategy_is_one_object_over_its_mesh():
    assert isinstance(make_strategy(DistConfig(), 4, 4), DDPStrategy)
    fsdp = make_strategy(DistConfig(strategy="fsdp", tensor_parallel=2), 8, 8)
    assert isinstance(fsdp, FSDPStrategy) and fsdp.dims == MeshShape("fsdp", 1, 4, 2) and fsdp.sharded_state
    hsdp = make_strategy(DistConfig(strategy="hsdp"), 16, 8)
    assert isinstance(hsdp, FSDPStrategy) and hsdp.dims.layout() == {"replicate": 2, "shard": 8}


class _TruncNormal(nn.Linear):
    def reset_parameters(self):
        nn.init.trunc_normal_(self.weight)  # torch skips it on meta tensors: nothing is written there
        nn.init.zeros_(self.bias)


class _ComputedBuffer(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("table", torch.arange(4.0))  # made in __init__ only: no init writes it


@pytest.mark.parametrize("factory, expected", [(lambda: GPT(n_layers=1, dim=32), True), (self_initialising, True),
                                               (lambda: nn.Linear(3, 4), True), (Network, False),
                                               (lambda: _TruncNormal(3, 4), False), (_ComputedBuffer, False)])
def test_which_models_initialise_their_own_shards(factory, expected):
    assert initialises_itself(build_on_meta(factory, 0)) == expected


@pytest.mark.parametrize("factory, whole_on_rank0", [(lambda: GPT(n_layers=2, dim=32), False), (Network, True)])
def test_a_sharded_build_starts_from_the_weights_of_one_process(factory, whole_on_rank0):
    with open_runtime(DistConfig(device="cpu")) as runtime:
        strategy = make_strategy(DistConfig(strategy="fsdp"), 1, 1)
        lines = []
        model = strategy.setup_module(Build(factory, 3, log=lines.append), runtime)
        weights = strategy.full_model_state(model)
    reference = build_whole(factory, 3).state_dict()
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], v) for k, v in reference.items())
    assert bool(lines) == whole_on_rank0
