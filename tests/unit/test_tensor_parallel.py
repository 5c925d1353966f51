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
    mesh = ParallelDims(1, 2, 2)
    plans = [make_plan(64, train, Runtime(rank, rank, 4, 4, torch.device("cpu"), "gloo"), mesh)
             for rank in range(4)]
    order = plans[0].order(0)
    batches = [torch.cat(plan.micro_batches(order, 1)) for plan in plans]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[2], batches[3])
    assert not set(batches[0].tolist()) & set(batches[2].tolist())
    assert sorted(torch.cat([batches[0], batches[2]]).tolist()) == sorted(order[16:32].tolist())


def test_heads_the_degree_does_not_divide_name_the_degrees_that_do():
    """Checked before any forward (the dry batch would blame the inputs); with the world's ranks per stage known
    (the launcher), only degrees that also tile them."""
    from distrib.models.gpt import GPT

    model = GPT(n_heads=6, dim=48, hidden_dim=96)
    with pytest.raises(ConfigError) as refused:
        tensor_parallel_plan(model, 4)
    assert str(refused.value) == (
        "dist.tensor_parallel = 4: GPT's 6 attention heads (model.kwargs n_heads) cannot be split 4 ways (each rank "
        "computes whole heads); use dist.tensor_parallel = 1, 2, 3 or 6 (e.g. --set dist.tensor_parallel=6), or set "
        "model.kwargs n_heads to a multiple of 4")
    with pytest.raises(ConfigError, match=r"use dist.tensor_parallel = 1 or 2 \(e.g. --set dist.tensor_parallel=2\)"):
        tensor_parallel_plan(model, 4, ranks=4)
    assert tensor_parallel_plan(model, 3) is GPT._tp_plan


def test_a_hugging_face_model_is_checked_in_the_launcher_and_its_own_styles_name_the_way():
    """transformers' Llama (4 heads, 2 key-value heads), built on meta from a factory that needs no data: its heads,
    then transformers' own plan styles, refused before any worker starts; the way the line names is then taken."""
    from distrib.config import load_config
    from distrib.distributed.tensor_parallel import KEEP_SUPPORTED
    from distrib.plan.layout import check_layout
    from tests.helpers.pretrained import llama

    def config(*sets):
        return load_config(None, ["dist.strategy=fsdp", "data.factory=tests.helpers.pretrained:token_dicts", *sets])

    llama_tp = ["model.factory=tests.helpers.pretrained:llama"]
    with pytest.raises(ConfigError) as refused:
        check_layout(config(*llama_tp, "dist.tensor_parallel=4"), 4, 4)
    assert str(refused.value) == (
        "dist.tensor_parallel = 4: LlamaForCausalLM's 2 key-value heads (config.num_key_value_heads) cannot be split "
        "4 ways (each rank computes whole heads); use dist.tensor_parallel = 1 or 2 (e.g. --set "
        "dist.tensor_parallel=2), or set config.num_attention_heads and config.num_key_value_heads to multiples of 4")
    with pytest.raises(ConfigError) as refused:
        check_layout(config(*llama_tp, "dist.tensor_parallel=2"), 4, 4)
    assert str(refused.value).startswith("dist.tensor_parallel = 2: LlamaForCausalLM._tp_plan entry 'lm_head': "
                                         "'colwise_gather_output' is not a style distrib applies")
    assert f"in the model factory keep those entries alone, {KEEP_SUPPORTED} (the" in str(refused.value)
    model = llama()
    exec(KEEP_SUPPORTED, {"model": model})  # the line's own words, as a factory would write them
    assert set(tensor_parallel_plan(model, 2).values()) == {"colwise", "rowwise"}
    assert len(model._tp_plan) == 7  # q, k, v, o, gate, up, down: embed_tokens and lm_head stay whole
    # A factory that needs the data's arguments is built in the workers only: they check it there.
    needs_data = config("model.factory=tests.helpers.dying_model:gpt", "dist.tensor_parallel=4")
    assert check_layout(needs_data, 4, 4).tensor_parallel == 4


def test_torchs_redistribute_warning_is_said_once_per_run(monkeypatch):
    """torch's DTensor logs "While redistributing from ..." (about 450 characters) in every process, for each mesh
    and reason: rank 0's first passes, the rest do not; torch's other records pass."""
    import logging

    from distrib.distributed.tensor_parallel import REDISTRIBUTE_LOGGER, quiet_redistribute_warning

    logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    quiet_redistribute_warning()
    quiet_redistribute_warning()  # once per process, however many models
    [quiet] = [each for each in logger.filters if type(each).__name__ == "_FirstOnRank0"]
    quiet.said = False

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord(REDISTRIBUTE_LOGGER, logging.WARNING, __file__, 1, msg, (), None)
    warning = "While redistributing from %s to %s, %d sequential %s operations will be performed. %s"
    assert [quiet.filter(record(msg)) for msg in (warning, warning, "another record")] == [True, False, True]
    quiet.said = False
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    assert [quiet.filter(record(msg)) for msg in (warning, "another record")] == [False, True]  # rank 1: never
