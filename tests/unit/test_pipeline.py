"""Pipeline parallel's pieces in one process: the parallel degrees and data ranks of a pp mesh, where models split
into stages (balanced by blocks, or at dist.pipeline_split) and the one-line refusals, views that keep the whole
model's names and share its tensors, a stage's initialisation drawing what one process draws, and the keys' checks.
(Training against one process: tests/integration/test_pipeline.py.)"""

import re

import pytest
import torch
import torch.nn as nn

from distrib.config import Config, DistConfig
from distrib.distributed import pipeline as pipeline_degree
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.pipeline import split_stages, stages_of, view
from distrib.distributed.strategies import FSDPStrategy, check_config, make_strategy, parallel_dims
from distrib.distributed.strategies.materialise import _WholeThenSlice, build_on_meta, build_whole
from distrib.errors import ConfigError
from distrib.models.gpt import GPT


def _gpt(n_layers: int = 4, tie_weights: bool = False) -> GPT:
    return GPT(vocab_size=32, seq_len=8, n_layers=n_layers, n_heads=2, dim=16, tie_weights=tie_weights)


def test_pipeline_is_the_outermost_dimension_and_its_stages_read_the_same_data():
    dims = parallel_dims(DistConfig(strategy="fsdp", pipeline_parallel=2, tensor_parallel=2), 8, 8)
    assert dims == ParallelDims(1, 2, 2, 2) and dims.dims() == (("pp", 2), ("shard", 2), ("tp", 2))
    assert dims.data_parallel == 2 and dims.loss_ranks == 4
    # ranks 0-3 hold stage 0, 4-7 stage 1; within each, tp pairs read the same micro-batches
    assert [dims.batch_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.pipeline_rank(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    ddp = parallel_dims(DistConfig(pipeline_parallel=2), 4, 4)  # ddp's replicas as FSDP2 over (replicate, shard 1)
    assert ddp.dims() == (("pp", 2), ("replicate", 2), ("shard", 1)) and ddp.data_parallel == 2
    assert isinstance(make_strategy(DistConfig(pipeline_parallel=2), 4, 4), FSDPStrategy)  # stages are FSDP2's
    with pytest.raises(ConfigError, match="dist.pipeline_parallel = 3: does not divide world size 4"):
        parallel_dims(DistConfig(strategy="fsdp", pipeline_parallel=3), 4, 4)


def test_the_gpt_splits_balanced_by_blocks_with_embeddings_first_and_the_head_last():
    split = split_stages(build_on_meta(_gpt, 0), 2, (), 2)
    assert split.stage_units(0) == ("tok_embeddings", "layers.0", "layers.1")
    assert split.stage_units(1) == ("layers.2", "layers.3", "norm", "output")
    three = split_stages(build_on_meta(lambda: _gpt(n_layers=5), 0), 3, (), 3)
    assert [len([u for u in three.stage_units(s) if u.startswith("layers")]) for s in range(3)] == [2, 1, 2]
    with pytest.raises(ConfigError, match="8 stages: more than GPT's 4 blocks; use fewer stages"):
        split_stages(build_on_meta(_gpt, 0), 8, (), 4)


def test_a_user_split_names_the_units_that_start_stages():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert split_stages(model, 2, ("2",), 2).stage_units(1) == ("2", "3", "4")
    with pytest.raises(ConfigError, match=r"1 names make 2 stages, and dist.pipeline_parallel = 2 x 2 stage\(s\) per "
                                          r"rank = 4 stages; give 3 names"):
        split_stages(model, 4, ("2",), 2)
    with pytest.raises(ConfigError, match="must follow the model's order"):
        split_stages(model, 3, ("3", "1"), 3)
    with pytest.raises(ConfigError, match="Sequential has no pipeline split of its own"):
        split_stages(model, 2, (), 2)

    class Custom(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ConfigError, match="Custom is neither an nn.Sequential nor declares its pipeline units"):
        split_stages(Custom(), 2, (), 2)


def test_stages_of_a_rank_loop_or_form_a_v():
    assert stages_of(0, 2, 2, "interleaved_1f1b") == [0, 2] and stages_of(1, 4, 1, "1f1b") == [1]
    assert stages_of(0, 2, 2, "zbv") == [0, 3]


def test_a_stage_view_keeps_the_model_names_and_shares_its_tensors():
    model = _gpt()
    split = split_stages(model, 2, (), 2)
    last = view(model, split.units, set(split.stage_units(1)))
    assert list(last.state_dict()) == [name for name in model.state_dict()
                                       if name.startswith(("layers.2", "layers.3", "norm", "output"))]
    assert last.layers._modules["2"].attention.wq.weight is model.layers[2].attention.wq.weight
    assert len(model.layers) == 4 and model.tok_embeddings is not None  # the model itself keeps every unit
    first = view(model, split.units, set(split.stage_units(0)))
    tokens = torch.randint(0, 32, (2, 8))
    assert torch.allclose(last(first(tokens)), model(tokens), atol=1e-6)  # stages in turn are the model


def test_a_stage_initialises_its_tensors_as_one_process_draws_them():
    whole = build_whole(_gpt, 3)
    model = build_on_meta(_gpt, 3)
    split = split_stages(model, 2, (), 2)
    last = view(model, split.units, set(split.stage_units(1)))
    last.to_empty(device="cpu")  # this stage's tensors real, the other stage's still on meta in `model`
    torch.manual_seed(3)
    with torch.no_grad(), _WholeThenSlice():
        model.reset_parameters()
    for name, tensor in last.state_dict().items():
        assert torch.equal(tensor, whole.state_dict()[name]), name


def test_tied_weights_across_stages_are_one_line():
    from distrib.distributed.pipeline.split import refuse_ties

    model = build_on_meta(lambda: _gpt(tie_weights=True), 0)
    split = split_stages(model, 2, (), 2)
    with pytest.raises(ConfigError, match=r"GPT ties output.weight to tok_embeddings.weight, which fall in different "
                                          r"stages; untie them"):
        refuse_ties(model, split, 2)


@pytest.mark.parametrize("overrides, says", [
    (dict(pipeline_split=("layers.2",)), "dist.pipeline_split = ('layers.2',): splits the model into pipeline stages, "
                                        "and dist.pipeline_parallel is 1"),
    (dict(pipeline_parallel=2, pipeline_schedule="1f1b", pipeline_stages_per_rank=2),
     "the 1f1b schedule runs one stage per rank"),
    (dict(pipeline_parallel=2, pipeline_schedule="interleaved_1f1b", pipeline_stages_per_rank=1),
     "interleaved_1f1b interleaves several stages per rank"),
    (dict(pipeline_parallel=2, pipeline_schedule="zbv"), "does not train the same model as one process"),
    (dict(pipeline_parallel=2, strategy="fsdp", cpu_offload=True), "not supported with dist.pipeline_parallel > 1")])
def test_pipeline_keys_that_do_not_fit_are_one_line(overrides, says):
    with pytest.raises(ConfigError, match=None) as error:
        check_config(Config(dist=DistConfig(**overrides)))  # the keys' own checks, then the pipeline's rules
    assert says in str(error.value) and "\n" not in str(error.value)


def test_microbatches_must_divide_the_micro_batch():
    strategy = make_strategy(DistConfig(strategy="fsdp", pipeline_parallel=2, pipeline_microbatches=3), 4, 4)
    with pytest.raises(ConfigError, match="dist.pipeline_microbatches = 3: does not divide the micro-batch of 8"):
        strategy.check_micro_batch(8)
    assert pipeline_degree.microbatches(DistConfig(strategy="fsdp", pipeline_parallel=2)) == 2


def test_the_step_runner_is_chosen_once_and_is_the_one_owner_of_a_ranks_stages():
    from distrib.distributed.pipeline import PipelineRunner
    from distrib.distributed.runner import Runner
    from distrib.distributed.runtime import Runtime
    from distrib.plan import fake_process_group

    plain = make_strategy(DistConfig(strategy="fsdp"), 4, 4)
    assert type(plain.runner) is Runner and plain.logs_extra_losses
    strategy = make_strategy(DistConfig(pipeline_parallel=2), 4, 4)  # chosen before any model is built
    assert isinstance(strategy.runner, PipelineRunner) and not strategy.logs_extra_losses
    with fake_process_group(4):  # rank 2: pipeline rank 1, the last stage's
        held = strategy.plan_module(build_on_meta(_gpt, 0), Runtime(2, 2, 4, 4, torch.device("cpu"), "fake"), "fp32")
    runner = strategy.runner
    assert held.pipeline is runner.pipeline  # the module's forward-only passes run the runner's stages
    assert list(runner.stages) == [1] and runner.roots(held) == [runner.stages[1]]
    assert "this rank holds stage 1 (" in runner.describe()[0]


def test_a_device_mismatch_inside_a_stage_names_the_stage():
    from distrib.distributed.parallel import explain_device_errors
    from distrib.distributed.pipeline.stages import Pipeline, _naming_stage
    from distrib.errors import DeviceMismatchError

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    pipeline = Pipeline(split_stages(model, 2, ("2",), 2), {}, None, ParallelDims(1, 1, pipeline=2), "1f1b", 2,
                        torch.device("cpu"), model)
    with pytest.raises(DeviceMismatchError) as error:
        with explain_device_errors(model, torch.device("cpu"), {}), _naming_stage(1, pipeline):
            torch.zeros(2, 10) + torch.zeros(10, device="meta")  # a tensor made in forward, elsewhere
    said = "(PyTorch said: pipeline stage 1 (2 .. 3): Tensor on device meta is not on the expected device"
    assert said in str(error.value)


# ---------------------------------------------------------------- Hugging Face decoders: their plan, a stage forward


def test_a_hugging_face_decoder_splits_by_its_own_pipeline_plan_and_its_stages_in_turn_are_the_model():
    from distrib.distributed.pipeline.decoder import stage_class
    from tests.helpers.pretrained import llama

    torch.manual_seed(0)
    model = llama(num_hidden_layers=4).eval()
    split = split_stages(model, 2, (), 2)
    assert split.units == ("model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm", "lm_head")
    assert split.stage_units(1) == ("model.layers.2", "model.layers.3", "model.norm", "lm_head")
    cls = stage_class(model)
    first, last = (view(model, split.units, set(split.stage_units(s)), cls) for s in (0, 1))
    assert isinstance(first, type(model)) and first.model.rotary_emb is model.model.rotary_emb  # no unit: in both
    tokens = torch.randint(0, 256, (2, 16))
    hidden = first(tokens)
    assert hidden.shape == (2, 16, 32)  # the hidden states the next stage receives, one tensor
    assert torch.allclose(last(hidden), model(tokens).logits, atol=1e-6)
    assert stage_class(_gpt()) is None  # the GPT's own forward runs a stage


def test_a_hugging_face_model_without_a_pipeline_plan_or_with_tied_embeddings_is_one_line():
    from transformers import GPT2Config, GPT2LMHeadModel

    from distrib.distributed.pipeline.split import refuse_ties
    from tests.helpers.pretrained import llama

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel is neither an nn.Sequential nor declares its pipeline "
                                          r"units .*'dist.pipeline_split=\[...\]'") as error:
        split_stages(gpt2, 2, (), 2)
    assert "\n" not in str(error.value)
    tied = llama(tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="LlamaForCausalLM ties lm_head.weight to model.embed_tokens.weight, which "
                                          "fall in different stages; untie them .*tie_word_embeddings = false"):
        refuse_ties(tied, split_stages(tied, 2, (), 2), 2)


def _held(model: nn.Module, stage: int):
    """One pipeline rank's stage of a model built on meta, materialised: what model.init_from loads into."""
    from types import SimpleNamespace

    from distrib.distributed.pipeline.stages import pipelined_view

    split = split_stages(model, 2, (), 2)
    held = pipelined_view(model, split.units, set(split.stage_units(stage)))
    held.to_empty(device="cpu")
    held.pipeline = SimpleNamespace(whole=model)  # what check_weights reads of the Pipeline: the whole model
    return held


@pytest.mark.parametrize("stage", [0, 1])
def test_init_from_under_pipeline_parallel_reads_each_stages_own_tensors(tmp_path, stage):
    from distrib.checkpoint.init_from import check_weights, load_weights, open_source
    from distrib.errors import UserError

    saved = _gpt()
    torch.save(saved.state_dict(), tmp_path / "model.pt")
    held = _held(build_on_meta(_gpt, 0), stage)
    line = load_weights(held, check_weights(held, open_source(str(tmp_path / "model.pt"))))
    assert len(held.state_dict()) < len(saved.state_dict())
    mib = lambda tensors: sum(t.numel() * t.element_size() for t in tensors) / 2**20  # noqa: E731
    read, whole = map(float, re.search(r"each rank read ([\d.]+) MiB of ([\d.]+) MiB", line).groups())
    assert (read, whole) == (round(mib(held.state_dict().values()), 2), round(mib(saved.state_dict().values()), 2))
    assert all(torch.equal(tensor, saved.state_dict()[name]) for name, tensor in held.state_dict().items())
    # another stage's tensor of another shape is refused on this rank too: every rank says the same line
    wider = build_on_meta(lambda: GPT(vocab_size=32, seq_len=8, n_layers=4, n_heads=2, dim=16, hidden_dim=48,
                                      tie_weights=False), 0)
    with pytest.raises(UserError, match="the weights do not fit the model, 12 mis-shaped \\(first layers.0"):
        check_weights(_held(wider, stage), open_source(str(tmp_path / "model.pt")))


def test_init_from_a_hugging_face_folder_into_one_stage_of_a_llama(tmp_path):
    from transformers import LlamaForCausalLM

    from distrib.checkpoint.init_from import check_weights, load_weights, open_source
    from distrib.distributed.strategies.materialise import build_for_loading
    from tests.helpers.pretrained import llama, save_llama

    folder = save_llama(tmp_path / "llama", num_hidden_layers=4)
    whole, _ = build_for_loading(lambda: llama(num_hidden_layers=4), 0)
    held = _held(whole, 1)
    load_weights(held, check_weights(held, open_source(str(folder))))
    reference = LlamaForCausalLM.from_pretrained(folder).state_dict()
    assert list(held.state_dict())[0] == "model.layers.2.self_attn.q_proj.weight"
    assert all(torch.equal(tensor, reference[name]) for name, tensor in held.state_dict().items())
    from distrib.checkpoint.weights import hf_config

    assert hf_config(held).architectures == ["LlamaForCausalLM"]  # weights/config.json names the model, not the view
