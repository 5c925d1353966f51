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
from tests.helpers.support import fake_rank


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
    assert tensor_parallel_plan(model, 3) == GPT._tp_plan


def test_a_hugging_face_model_is_checked_in_the_launcher_and_its_own_plan_taken_as_is():
    """transformers' Llama (4 heads, 2 key-value heads), built on meta from a factory that needs no data: its heads
    refused before any worker starts, its own plan (every style in it) taken as it is."""
    from distrib.config import load_config
    from distrib.plan.layout import check_layout

    def config(*sets):
        return load_config(None, ["dist.strategy=fsdp", "data.factory=tests.helpers.pretrained:token_dicts", *sets])

    llama_tp = ["model.factory=tests.helpers.pretrained:llama"]
    with pytest.raises(ConfigError) as refused:
        check_layout(config(*llama_tp, "dist.tensor_parallel=4"), 4, 4)
    assert str(refused.value) == (
        "dist.tensor_parallel = 4: LlamaForCausalLM's 2 key-value heads (config.num_key_value_heads) cannot be split "
        "4 ways (each rank computes whole heads); use dist.tensor_parallel = 1 or 2 (e.g. --set "
        "dist.tensor_parallel=2), or set config.num_attention_heads and config.num_key_value_heads to multiples of 4")
    assert check_layout(config(*llama_tp, "dist.tensor_parallel=2"), 4, 4).tensor_parallel == 2
    # A factory that needs the data's arguments is built in the workers only: they check it there.
    needs_data = config("model.factory=tests.helpers.dying_model:gpt", "dist.tensor_parallel=4")
    assert check_layout(needs_data, 4, 4).tensor_parallel == 4


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def _tiny(kind: str, **changes):
    import transformers

    config = getattr(transformers, f"{kind}Config")(**{**TINY, **changes})
    return getattr(transformers, f"{kind}ForCausalLM")(config)


def test_each_of_transformers_styles_is_torchs_style_laid_out_as_transformers_lays_it_out():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from distrib.distributed.tensor_parallel import STYLES, torch_style

    def layouts(style):
        return type(style), *style.input_layouts, *style.output_layouts, style.use_local_output

    assert layouts(torch_style("colwise")) == (ColwiseParallel, Replicate(), Shard(-1), True)  # q/k/v: local heads
    assert layouts(torch_style("rowwise")) == (RowwiseParallel, Shard(-1), Replicate(), True)  # input already split
    assert layouts(torch_style("colwise_gather_output")) == (ColwiseParallel, Replicate(), Replicate(), True)
    assert layouts(torch_style("embedding_rowwise")) == (RowwiseParallel, Replicate(), Replicate(), True)
    sequence = torch_style("sequence_parallel")
    assert type(sequence) is SequenceParallel and sequence.sequence_sharding == (Shard(1),)
    assert sequence.use_local_output  # as transformers': the norm's output a plain tensor
    assert type(torch_style("replicated_with_grad_allreduce")).__name__ == "_ReplicatedWithGradAllReduce"
    assert len(STYLES) == 6


def test_a_style_distrib_does_not_apply_and_gpt2_are_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = _tiny("Qwen2")
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp.gate_proj": "local_colwise"}
    with pytest.raises(ConfigError) as refused:
        tensor_parallel_plan(model, 2)
    assert str(refused.value) == (
        "dist.tensor_parallel = 2: Qwen2ForCausalLM._tp_plan entry 'model.layers.*.mlp.gate_proj': 'local_colwise' "
        "is not a style distrib applies (colwise, rowwise, colwise_gather_output, embedding_rowwise, "
        "replicated_with_grad_allreduce, sequence_parallel; packed and expert styles are not); use --set "
        "dist.tensor_parallel=1")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ConfigError) as refused:
        tensor_parallel_plan(gpt2, 2)
    assert str(refused.value) == (
        "dist.tensor_parallel = 2: the model (GPT2LMHeadModel) declares no tensor-parallel plan (a _tp_plan of module "
        "names -> styles, as transformers' Llama and Qwen2 and the built-in GPT declare); use --set "
        "dist.tensor_parallel=1 (fsdp or hsdp alone), or model.name = gpt")
    gpt2._tp_plan = {"transformer.h.*.attn.c_attn": "colwise"}  # a plan of one's own: its Conv1D is no nn.Linear
    with pytest.raises(ConfigError, match=r"^dist.tensor_parallel = 2: GPT2LMHeadModel._tp_plan entry 'transformer.h"
                                          r".\*.attn.c_attn': transformer.h.0.attn.c_attn is a Conv1D; colwise splits "
                                          r"nn.Linear layers only; use --set dist.tensor_parallel=1$"):
        tensor_parallel_plan(gpt2, 2)


@pytest.mark.parametrize("kind", ["Llama", "Qwen2"])
def test_transformers_own_plan_splits_every_linear_the_embedding_and_the_head_as_transformers_does(kind):
    """The plan as transformers declares it (the base model's entries under `model.`), applied over a tensor-parallel
    group of 2 (rank 0 of a fake group): each weight split where transformers splits it, norms whole, the logits
    gathered whole, and no warning from torch."""
    import warnings

    from torch.distributed.tensor import DTensor, Shard

    from distrib.distributed.tensor_parallel import apply_tensor_parallel, planned_modules

    torch.manual_seed(0)
    model = _tiny(kind)
    planned = planned_modules(model, tensor_parallel_plan(model, 2))
    splits = {name: module for name, module in model.named_modules()
              if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))}
    assert planned.keys() == splits.keys() and len(planned) == 2 + 2 * 7
    with fake_rank(0, 2), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        apply_tensor_parallel(model, ParallelDims(1, 1, 2).build_mesh("cpu")["tp"])
        logits = model(torch.randint(0, 128, (2, 8))).logits
        logits.sum().backward()
    assert not said and type(logits) is torch.Tensor and logits.shape == (2, 8, 128)
    placed = {name: (param.placements, param.to_local().shape) for name, param in model.named_parameters()
              if isinstance(param, DTensor)}
    assert placed.pop("model.embed_tokens.weight") == ((Shard(0),), (64, 64))  # the vocabulary split
    assert placed.pop("lm_head.weight") == ((Shard(0),), (64, 64))
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for name, rows in (("q", 32), ("k", 16), ("v", 16)):  # 2 of 4 heads, 1 of 2 key-value heads, of 16
            assert placed.pop(f"{prefix}self_attn.{name}_proj.weight") == ((Shard(0),), (rows, 64))
            if kind == "Qwen2":
                assert placed.pop(f"{prefix}self_attn.{name}_proj.bias") == ((Shard(0),), (rows,))
        assert placed.pop(f"{prefix}self_attn.o_proj.weight") == ((Shard(1),), (64, 32))
        assert placed.pop(f"{prefix}mlp.gate_proj.weight") == placed.pop(f"{prefix}mlp.up_proj.weight") == (
            (Shard(0),), (64, 64))
        assert placed.pop(f"{prefix}mlp.down_proj.weight") == ((Shard(1),), (64, 64))
    assert not placed  # the norms stay whole
    assert all(param.grad is not None for param in model.parameters())


def test_a_split_module_under_fsdp_returns_a_tensor_of_its_own_and_fsdp_warns_of_no_view():
    """torch's styles return a split module's output as a view of its DTensor's local tensor; FSDP2 warns ("returned
    a view tensor ... wrong gradients") for a unit whose output that is, the embedding, the head and the model at tp 2
    x fsdp 2 (a pipeline's last stage ends with the head): each is a tensor of its own, and the gradients flow."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    from distrib.distributed.tensor_parallel import apply_tensor_parallel

    model = _tiny("Llama")
    with fake_rank(0, 4), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dims = ParallelDims(1, 2, 2)
        mesh = dims.build_mesh("cpu")
        apply_tensor_parallel(model, mesh["tp"])
        for unit in (model.model.embed_tokens, model.lm_head, model):
            fully_shard(unit, mesh=dims.data_parallel_mesh())
        outputs = []
        model.model.embed_tokens.register_forward_hook(lambda module, args, output: outputs.append(output))
        logits = model(torch.randint(0, 128, (2, 8))).logits
        logits.sum().backward()
    assert not [str(each.message) for each in said if "view tensor" in str(each.message)]
    assert outputs[0]._base is None and logits._base is None  # not views
    assert all(param.grad is not None for param in model.parameters())


def test_the_vocabulary_split_embeddings_gradient_is_its_slice_of_the_whole_one(monkeypatch):
    """DTensor has no row-wise rule for an embedding's backward: its weight gradient comes out whole (Replicate) on
    every tp rank, which autograd and FSDP2 would keep (and sum over the microbatches in float32) until the reduction.
    distrib lays it out as the weight in the backward: rank 0's rows of the whole gradient, the same values (the
    reference: the same pass without distrib's layout), and the module's own parameter is back after the pass."""
    from torch.distributed.tensor import Replicate, Shard

    import distrib.distributed.tensor_parallel as tp

    grads = {}
    for name in ("whole", "split"):
        if name == "whole":
            monkeypatch.setattr(tp, "_split_gradient", lambda module: None)
        else:
            monkeypatch.undo()
        torch.manual_seed(0)
        model = _tiny("Llama")
        with fake_rank(0, 2):
            tp.apply_tensor_parallel(model, ParallelDims(1, 1, 2).build_mesh("cpu")["tp"])
            model(torch.randint(0, 128, (2, 8))).logits.square().sum().backward()
        weight = model.model.embed_tokens.weight
        assert weight is model.model.embed_tokens._parameters["weight"] and weight.is_leaf
        grads[name] = (weight.grad.placements, weight.grad.to_local())
    assert grads["whole"][0] == (Replicate(),) and grads["whole"][1].shape == (128, 64)
    assert grads["split"][0] == (Shard(0),) and torch.equal(grads["split"][1], grads["whole"][1][:64])


def test_a_tied_head_is_split_once_and_a_tie_split_two_ways_is_one_line():
    from distrib.distributed.tensor_parallel import apply_tensor_parallel

    mesh = ParallelDims(1, 1, 2)
    with fake_rank(0, 2):
        model = _tiny("Qwen2", tie_word_embeddings=True)
        apply_tensor_parallel(model, mesh.build_mesh("cpu")["tp"])
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert [name for name, _ in model.named_parameters()].count("lm_head.weight") == 0  # one parameter
        model = _tiny("Qwen2", tie_word_embeddings=True)
        del model._tp_plan["model.embed_tokens"]
        with pytest.raises(ConfigError, match=r"Qwen2ForCausalLM ties model.embed_tokens.weight \(whole\) and "
                                              r"lm_head.weight \(colwise_gather_output\), which the plan lays out "
                                              "differently; give them one style, untie them"):
            apply_tensor_parallel(model, mesh.mesh["tp"])


def test_norms_that_see_one_ranks_heads_sum_their_gradients_over_the_group(monkeypatch):
    """Qwen3's per-head q_norm and k_norm (replicated_with_grad_allreduce) stay whole on every rank; their gradient is
    the sum over the group (a fake group's all-reduce, doubled here as two ranks of equal parts would sum) and the
    input's is not; the module's own parameter is back once the pass is over."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from distrib.distributed.tensor_parallel import apply_tensor_parallel, planned_modules, torch_style

    qwen3 = _tiny("Qwen3", head_dim=16)
    planned = planned_modules(qwen3, tensor_parallel_plan(qwen3, 2))
    assert {name for name, style in planned.items() if style == "replicated_with_grad_allreduce"} == {
        f"model.layers.{layer}.self_attn.{norm}" for layer in range(2) for norm in ("q_norm", "k_norm")}
    torch.manual_seed(0)
    norm, reference = torch.nn.RMSNorm(16), torch.nn.RMSNorm(16)
    torch.nn.init.normal_(norm.weight)
    reference.load_state_dict(norm.state_dict())
    x = torch.randn(2, 3, 16)
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    reference(inputs[0]).square().sum().backward()
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: tensor.mul_(2))
    with fake_rank(0, 2):
        mesh = ParallelDims(1, 1, 2).build_mesh("cpu")["tp"]
        apply_tensor_parallel(qwen3, mesh)
        assert not any(isinstance(param, DTensor) for name, param in qwen3.named_parameters() if "_norm" in name)
        parallelize_module(norm, mesh, torch_style("replicated_with_grad_allreduce"))
        norm(inputs[1]).square().sum().backward()
    assert torch.allclose(norm.weight.grad, 2 * reference.weight.grad)
    assert torch.equal(inputs[1].grad, inputs[0].grad)
    assert type(norm.weight) is torch.nn.Parameter and norm.weight is norm._parameters["weight"]


def test_one_pipeline_stage_takes_the_plan_entries_of_its_own_modules_without_a_warning():
    """Under pp the plan is applied to one rank's stages (a view without the other stages' units): an entry naming
    another stage's module only is not refused there, and the `*` form resolves module by module, where torch's own
    resolution warns once per subtree a pattern does not reach (84 warnings at pp 2 x tp 2 x fsdp 2)."""
    import warnings

    from torch.distributed.tensor import DTensor

    from distrib.distributed.pipeline.stages import pipelined_view
    from distrib.distributed.tensor_parallel import apply_tensor_parallel

    model = _tiny("Llama")
    model._tp_plan = {**model._tp_plan, "model.layers.1.self_attn.o_proj": "rowwise"}  # another stage's only
    units = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
    first = pipelined_view(model, units, {"model.embed_tokens", "model.layers.0"})
    with pytest.raises(ConfigError, match="'model.layers.7.mlp.up_proj': names no module of the model"):
        tensor_parallel_plan(_with_entry(_tiny("Llama"), "model.layers.7.mlp.up_proj"), 2)  # the whole model: a typo
    blocks = torch.nn.Sequential(torch.nn.Embedding(8, 4), *[torch.nn.Sequential() for _ in range(2)])
    for block in blocks[1:]:
        block.fc = torch.nn.Linear(4, 4)
    blocks._tp_plan = {"*.fc": "colwise"}  # torch's resolution: "no submodule matching token 'fc'" in the Embedding
    with fake_rank(0, 2), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        apply_tensor_parallel(first, ParallelDims(1, 1, 2).build_mesh("cpu")["tp"], stage=True)
        apply_tensor_parallel(blocks, ParallelDims(1, 1, 2).build_mesh("cpu")["tp"])
    assert not said and all(isinstance(block.fc.weight, DTensor) for block in blocks[1:])
    split = {name for name, param in model.named_parameters() if isinstance(param, DTensor)}
    assert split == {name for name, _ in first.named_parameters() if "layernorm" not in name}
    assert "lm_head.weight" not in split and "model.layers.1.self_attn.o_proj.weight" not in split


def _with_entry(model, name: str, style: str = "colwise"):
    model._tp_plan = {**model._tp_plan, name: style}
    return model


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
