"""The strategy objects in one process: the names each registers and the config lists, the mesh each gets, the
refusal of a trained model's evaluation by a sharded one, which models initialise their own shards
(checked on the meta device), the sharded build at world size 1 giving bitwise the weights one process builds, and
weights loaded into the shards of a model never built whole (rank 1 of fsdp 2, a fake group)."""

import pytest
import torch
import torch.nn as nn

from distrib.config import DistConfig, SpeedConfig, choices
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime, open_runtime
from distrib.distributed.strategies import (
    Build,
    DDPStrategy,
    FSDPStrategy,
    make_strategy,
    materialise,
    registered,
    strategy_named,
)
from distrib.distributed.strategies import base as strategy_base
from distrib.distributed.strategies.materialise import build_on_meta, build_whole, initialises_itself
from distrib.errors import ConfigError, UserError
from distrib.models.gpt import GPT
from distrib.models.network import Network
from tests.helpers.factories import self_initialising
from tests.helpers.pretrained import llama, save_llama
from tests.helpers.support import fake_rank


def test_every_strategy_is_one_object_over_its_mesh():
    assert isinstance(make_strategy(DistConfig(), 4, 4), DDPStrategy)
    fsdp = make_strategy(DistConfig(strategy="fsdp", tensor_parallel=2), 8, 8)
    assert isinstance(fsdp, FSDPStrategy) and fsdp.dims == ParallelDims(1, 4, 2) and fsdp.sharded_state
    hsdp = make_strategy(DistConfig(strategy="hsdp"), 16, 8)
    assert isinstance(hsdp, FSDPStrategy) and hsdp.dims.layout() == {"replicate": 2, "shard": 8}


def test_each_strategy_registers_its_names_and_the_config_lists_the_same():
    assert {name: cls.__name__ for name, cls in registered().items()} == {
        "ddp": "DDPStrategy", "fsdp": "FSDPStrategy", "hsdp": "FSDPStrategy"}  # hsdp: fsdp with a replicate degree
    # config.py imports no strategy (no torch): its choices are the docs' list and load_config's check
    assert choices(DistConfig, "strategy") == tuple(registered())
    with pytest.raises(ConfigError) as caught:
        strategy_named("zero")
    assert str(caught.value) == ("dist.strategy = 'zero': no strategy registers that name; use one of ddp, fsdp, "
                                 "hsdp, e.g. --set dist.strategy=ddp")


def test_a_new_strategy_registers_itself_by_being_defined(monkeypatch):
    monkeypatch.setattr(strategy_base, "_REGISTERED", dict(strategy_base._REGISTERED))  # undone after the test

    class Zero2(FSDPStrategy):
        names = ("zero2",)

    assert strategy_named("zero2") is Zero2 and strategy_named("fsdp") is FSDPStrategy  # its parent's names stay
    with pytest.raises(AssertionError, match="'zero2' registered by Zero2 too"):
        class Again(FSDPStrategy):
            names = ("zero2",)


def test_a_sharded_strategy_refuses_to_run_a_trained_model_whole():
    with pytest.raises(UserError, match="FSDPStrategy shards the model, and evaluating a trained model runs it whole"):
        make_strategy(DistConfig(strategy="fsdp"), 1, 1).setup_trained(nn.Linear(2, 2), None, SpeedConfig())


class _TruncNormal(nn.Linear):
    def reset_parameters(self):
        nn.init.trunc_normal_(self.weight)  # torch skips it on meta tensors: nothing is written there
        nn.init.zeros_(self.bias)


class _ComputedBuffer(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("table", torch.arange(4.0))  # made in __init__ only: no init writes it


class _BufferOfParameters(nn.Linear):
    def __init__(self):
        super().__init__(4, 4)
        self.register_buffer("norms", self.weight.detach().norm(dim=1), persistent=False)  # in no weights file


def test_a_buffer_that_cannot_be_made_without_the_weights_is_one_line():
    with pytest.raises(UserError, match="buffer norms is computed from its parameters in its constructor"):
        materialise.build_for_loading(_BufferOfParameters, 0)
    model, kept = materialise.build_for_loading(_ComputedBuffer, 0)  # persistent: read from the weights, not kept
    assert model.weight.is_meta and kept == {} and torch.equal(model.table, torch.arange(4.0))


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


def test_weights_to_load_fill_the_shards_of_a_model_never_built_whole(tmp_path, monkeypatch):
    """model.init_from's way in (Build.load_weights) on rank 1 of fsdp 2: the factory's parameters are on the meta
    device from their creation, neither the model's initialisation nor rank 0's whole build runs, the rank's shards
    hold its rows of the file, and the buffers the file lacks (a Llama's rotary inv_freq, non-persistent) are the
    constructor's."""
    from transformers import LlamaForCausalLM

    from distrib.checkpoint.init_from import check_weights, load_weights, open_source

    folder = save_llama(tmp_path / "llama")
    reference = LlamaForCausalLM.from_pretrained(folder)
    for name in ("load_from_rank0", "init_shards", "build_whole"):
        monkeypatch.setattr(materialise, name, lambda *args, name=name: pytest.fail(f"{name} ran"))
    devices, lines = [], []

    def factory():
        model = llama()
        devices.append({t.device.type for t in model.parameters()} | {f"buffers {t.device.type}"
                                                                       for t in model.buffers()})
        return model

    with fake_rank(1, 2):
        strategy = make_strategy(DistConfig(strategy="fsdp"), 2, 2)
        runtime = Runtime(1, 1, 2, 2, torch.device("cpu"), "fake")
        load = lambda model: load_weights(model, check_weights(model, open_source(str(folder))))  # noqa: E731
        model = strategy.setup_module(Build(factory, 3, load_weights=load, log=lines.append), runtime)
        for name, tensor in reference.state_dict().items():
            assert torch.equal(model.state_dict()[name].to_local(), tensor[tensor.shape[0] // 2:]), name
        buffers = dict(model.named_buffers())
        assert all(torch.equal(buffers[name], buffer) for name, buffer in reference.named_buffers())
    assert devices == [{"meta", "buffers cpu"}]
    assert len(lines) == 1 and "no rank held the model whole" in lines[0], lines


def test_sharded_models_of_64_mib_and_more_have_freed_host_memory_returned_on_the_cpu(monkeypatch):
    """Only there is what glibc keeps of the gathers worth the page faults (docs/performance.md, "The host
    allocator")."""
    from distrib.distributed import runtime as runtime_module
    from distrib.distributed.strategies import fsdp as fsdp_strategy

    calls = []
    monkeypatch.setattr(runtime_module, "return_freed_memory", lambda: calls.append(1) or True)
    cpu, gpu = (Runtime(0, 0, 1, 1, torch.device(kind), "fake") for kind in ("cpu", "cuda"))
    with torch.device("meta"):
        large, small = nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 4095, bias=False)  # 64 MiB, just below
    for model, runtime in ((small, cpu), (large, gpu), (large, cpu)):
        fsdp_strategy._return_freed_memory_if_large(model, runtime)
    assert calls == [1]
