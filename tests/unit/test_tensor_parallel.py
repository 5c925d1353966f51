"""Tensor parallel in process: a model without a plan refused in one line (also by distrib plan, through the run's
own sharding code), a width that does not divide, and the ranks of one group reading the same micro-batches."""

import pytest
import torch

from distrib.config import TrainConfig
from distrib.data.batching import make_plan
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime
from distrib.distributed.tensor_parallel import tensor_parallel_plan
from distrib.errors import ConfigError
from distrib.models.network import Network


def test_a_model_without_a_plan_is_refused_in_one_line(capsys):
    with pytest.raises(ConfigError, match=r"dist.tensor_parallel = 2: the model \(Network\) declares no "):
        tensor_parallel_plan(Network(), 2)
    from distrib.cli import main

    assert main(["plan", "--set", "data.name=synthetic", "--set", "dist.strategy=fsdp", "--set",
                 "dist.tensor_parallel=2", "--world-size", "4"]) == 2  # the run's own sharding code refuses it
    err = capsys.readouterr().err
    assert "declares no tensor-parallel plan" in err and err.count("\n") == 1


def test_a_plan_that_does_not_divide_is_refused():
    from distrib.models.gpt import GPT as Model

    with pytest.raises(ConfigError, match="cannot be split 3 ways"):
        tensor_parallel_plan(Model(n_heads=4, dim=64), 3)


def test_the_ranks_of_one_tensor_parallel_group_read_the_same_micro_batches():
    train = TrainConfig(global_batch_size=16, grad_accum_steps=2)
    mesh = ParallelDims("fsdp", 1, 2, 2)
    plans = [make_plan(64, train, Runtime(rank, rank, 4, 4, torch.device("cpu"), "gloo", mesh=mesh))
             for rank in range(4)]
    order = plans[0].order(0)
    batches = [torch.cat(plan.micro_batches(order, 1)) for plan in plans]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[2], batches[3])
    assert not set(batches[0].tolist()) & set(batches[2].tolist())
    assert sorted(torch.cat([batches[0], batches[2]]).tolist()) == sorted(order[16:32].tolist())
