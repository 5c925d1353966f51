"""Context parallel in one process: the balanced cut of a window and its inverse, the mask of global places, the
gathered attention's math (each rank's queries over the keys gathered in rank order equal full causal attention on
those rows, and their gradients sum to full attention's), a transformers Llama's and packed documents' cut windows
run by two threads as ranks (each document's logits as alone), the mesh's `cp` dimension, the loss's shares, and the
refusals. (Against one process at world size 4: tests/integration/test_context_parallel.py)"""

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distrib.config import DistConfig, load_config
from distrib.data.documents import packed_inputs
from distrib.distributed import dimensions
from distrib.distributed.context_parallel import (
    ATTEND,
    HF_ATTENTION,
    GatheredAttention,
    causal_mask,
    chunk_places,
    cut,
    cut_batch,
    gathered_places,
    reach_attention,
    restore,
)
from distrib.distributed.dimensions.context import ContextParallel
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.pipeline import split_stages, view
from distrib.distributed.pipeline.decoder import stage_class
from distrib.distributed.runner import Runner
from distrib.distributed.step_inputs import microbatch, step_inputs, stepping
from distrib.distributed.strategies import parallel_dims
from distrib.errors import ConfigError
from distrib.models.gpt import GPT
from tests.helpers.pretrained import llama


def test_each_rank_holds_a_chunk_from_the_head_and_its_mirror_from_the_tail_and_the_cut_inverts():
    assert chunk_places(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_places(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(gathered_places(24, 3).tolist()) == list(range(24))
    window = torch.arange(2 * 24 * 5).view(2, 24, 5)
    chunks = [cut(window, chunk_places(24, 3, rank)) for rank in range(3)]
    assert all(chunk.shape == (2, 8, 5) for chunk in chunks)
    assert torch.equal(restore(chunks, 3), window)


def test_the_mask_is_the_causal_triangle_on_global_places():
    places = gathered_places(8, 2)
    for rank in range(2):
        rows = chunk_places(8, 2, rank)
        full = torch.ones(8, 8).tril().bool()
        assert torch.equal(causal_mask(rows, places), full[rows][:, places])


class _InProcess(GatheredAttention):
    """Every rank's attention in one process: the 'gather' is the whole window's keys or values, cut in rank order."""

    def __init__(self, mask, whole: dict[int, torch.Tensor]):
        super().__init__(mask, group=None)
        self.whole = whole

    def gather(self, rows):
        return self.whole[rows.data_ptr()]


def test_the_cut_attention_over_gathered_keys_equals_full_causal_attention_and_its_gradients():
    torch.manual_seed(0)
    degree, length = 2, 16
    q, k, v = (torch.randn(2, 3, length, 8, requires_grad=True) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = torch.autograd.grad(full.square().sum(), (q, k, v))
    places = gathered_places(length, degree)
    outs = []
    for rank in range(degree):
        rows = chunk_places(length, degree, rank)
        local = [x.index_select(2, rows) for x in (q, k, v)]
        whole = {local[1].data_ptr(): k.index_select(2, places), local[2].data_ptr(): v.index_select(2, places)}
        outs.append(_InProcess(causal_mask(rows, places), whole)(*local).transpose(1, 2))
    got = restore(outs, degree).transpose(1, 2)
    torch.testing.assert_close(got, full, rtol=0, atol=2e-6)
    for mine, theirs in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), expected):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_the_gpt_on_its_own_places_with_its_own_attention_is_the_whole_forward():
    """position_ids and an attend of the whole window (one rank's 'cut' of all of it) change nothing."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, seq_len=16, n_layers=2, n_heads=2, dim=16)
    tokens = torch.randint(0, 32, (2, 16))
    places = torch.arange(16)
    attend = GatheredAttention(causal_mask(places, places), group=None)
    attend.gather = lambda rows: rows
    torch.testing.assert_close(model(tokens, position_ids=places.expand(2, -1), attend=attend), model(tokens),
                               rtol=0, atol=1e-6)


def test_a_pipeline_stage_handed_its_input_alone_runs_the_steps_cut_and_a_pass_outside_the_step_the_whole_window():
    """Under pp x cp the stages pass the activations alone: the step's positions and attend reach each stage's blocks
    (stepping), each microbatch's rows; outside the step (evaluation) nothing is left of them."""
    torch.manual_seed(0)
    model = GPT(vocab_size=32, seq_len=16, n_layers=2, n_heads=2, dim=16)
    tokens = torch.randint(0, 32, (2, 16))
    places = chunk_places(16, 2, 0)  # rank 0's chunks: places 0..3 and 12..15, its keys alone (a gather of one)
    attend = GatheredAttention(causal_mask(places, places), group=None)
    attend.gather = lambda rows: rows
    model_inputs = {"input_ids": cut(tokens, places), "position_ids": places.expand(2, -1), ATTEND: attend}
    expected = model(**model_inputs)
    with stepping(model_inputs, microbatches=2) as handed, microbatch(1):
        assert handed is model_inputs["input_ids"]
        torch.testing.assert_close(model(handed[1:]), expected[1:], rtol=0, atol=0)  # the second microbatch
    assert step_inputs() is None
    torch.testing.assert_close(model(handed), model(cut(tokens, places)), rtol=0, atol=0)  # the causal triangle
    assert (model(handed) - expected).abs().max() > 1e-5  # which is not the step's attention at these places


def test_the_cp_mesh_dimension_sits_between_shard_and_tp():
    dims = parallel_dims(DistConfig(strategy="fsdp", context_parallel=2, tensor_parallel=2), 8, 8)
    assert (dims.shard, dims.context_parallel, dims.tensor_parallel, dims.world_size) == (2, 2, 2, 8)
    assert dims.dims() == dimensions.mesh_dims(dims) == (("shard", 2), ("cp", 2), ("tp", 2))
    assert dims.describe() == dimensions.describe(dims) == "shard 2 x cp 2 x tp 2"
    assert dimensions.layout_words(dims) == ": shard 2 x cp 2 x tp 2"
    assert dims.coordinate(5) == {"pp": 0, "replicate": 0, "shard": 1, "cp": 0, "tp": 1, "ep": 0}
    assert all(dims.rank_at(**{n: c for n, c in dims.coordinate(r).items() if n != "ep"}) == r for r in range(8))
    assert dims.data_parallel == 2 and dims.loss_ranks == 8  # the cp ranks read the same batches, all hold a loss
    assert {dims.batch_rank(r) for r in (0, 1, 2, 3)} == {0}


def test_the_loss_is_normalised_into_c_shares_a_rank():
    assert Runner(ParallelDims(1, 2, context_parallel=2)).loss_shares(4) == 8
    assert Runner(ParallelDims(1, 4)).loss_shares(4) == 4 == Runner().loss_shares(4)


@pytest.mark.parametrize("keys, words", [
    (["dist.strategy=ddp"], "composes with fsdp or hsdp"),
    (["dist.strategy=fsdp", "data.seq_len=30"], "data.seq_len = 30 is not a multiple of 4; set --set data.seq_len=28"),
])
def test_refusals_in_one_line(keys, words):
    with pytest.raises(ConfigError, match=words) as refused:
        dimensions.check(load_config(None, ["dist.context_parallel=2", *keys]))
    assert "\n" not in str(refused.value)


def test_a_world_it_does_not_divide_and_a_model_whose_attention_it_cannot_reach_are_refused():
    with pytest.raises(ConfigError, match="dist.context_parallel = 3: does not divide"):
        parallel_dims(DistConfig(strategy="fsdp", context_parallel=3), 4, 4)
    with pytest.raises(ConfigError, match="the attention of Sequential cannot be reached"):
        ContextParallel().check_model(nn.Sequential(nn.Linear(2, 2)), ParallelDims(1, 2, context_parallel=2), 4)
    ContextParallel().check_model(GPT(), ParallelDims(1, 2, context_parallel=2), 4)  # the built-in GPT's is reached
    # under pp x cp a stage is handed its activations alone: the GPT and a transformers decoder's stage read the step's
    ContextParallel().check_model(llama(vocab_size=64), ParallelDims(1, 2, context_parallel=2, pipeline=2), 8)
    ContextParallel().check_model(GPT(), ParallelDims(1, 2, context_parallel=2, pipeline=2), 8)


class _Threads(GatheredAttention):
    """One rank of a group of ranks run as threads of one process: the 'all-gather' of each rank's rows in rank order,
    through a barrier."""

    def __init__(self, mask, rank: int, slots: list, barrier: threading.Barrier):
        super().__init__(mask, group=None)
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def gather(self, rows):
        self.slots[self.rank] = rows
        self.barrier.wait()
        gathered = torch.cat(self.slots, dim=2)
        self.barrier.wait()  # every rank has read the slots before any writes the next layer's
        return gathered

    def rows(self, samples):
        return _Threads(self.mask[samples] if self.mask.dim() == 4 else self.mask, self.rank, self.slots, self.barrier)


def _logits(model, inputs) -> torch.Tensor:
    outputs = model(**inputs) if isinstance(model, GPT) else model(**inputs, use_cache=False)
    return outputs if isinstance(outputs, torch.Tensor) else outputs.logits


def _staged(model, microbatches: int = 1):
    """The model as two pipeline stages in turn, each handed its input alone inside the step (stepping), one
    microbatch (one sample a microbatch) after the other: the built-in GPT's views, or a transformers decoder's stage
    views (decoder.stage_class)."""
    split = split_stages(model, 2, (), 2)
    first, last = (view(model, split.units, set(split.stage_units(stage)), stage_class(model)) for stage in (0, 1))

    def run(**inputs) -> torch.Tensor:
        with stepping(inputs, microbatches) as tokens:
            pieces = torch.tensor_split(tokens, microbatches)
            outs = []
            for index, piece in enumerate(pieces):
                with microbatch(index):
                    outs.append(last(first(piece)))
            return torch.cat(outs)

    return run


def _under_cp(model, inputs, degree: int = 2, staged: int = 0) -> torch.Tensor:
    """The model's logits of the window(s) when each of `degree` ranks (threads) runs its cut (cut_batch), restored;
    staged: through two pipeline stages handed their input alone, in that many microbatches (_staged)."""
    tokens = inputs["input_ids"] if isinstance(inputs, dict) else inputs
    slots, barrier, outs = [None] * degree, threading.Barrier(degree, timeout=60), [None] * degree
    run = _staged(model, staged) if staged else None

    def rank(index: int) -> None:
        cut_inputs, _ = cut_batch(inputs, tokens, degree, index, group=None)
        cut_inputs[ATTEND] = _Threads(cut_inputs[ATTEND].mask, index, slots, barrier)
        outs[index] = run(**cut_inputs) if staged else _logits(model, cut_inputs)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(degree)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return restore(outs, degree)


def _models():
    torch.manual_seed(0)
    return {"gpt": GPT(vocab_size=64, seq_len=32, n_layers=2, n_heads=4, dim=32),
            "llama": reach_attention(llama(vocab_size=64, max_position_embeddings=32))}  # GQA: 4 heads, 2 kv heads


@torch.no_grad()
@pytest.mark.parametrize("staged", [0, 2])
def test_a_transformers_llama_under_cp2_runs_the_gathered_attention_and_equals_the_whole_window(staged):
    """And as two pipeline stages handed their input alone (pp x cp): the step's places and gathered attention."""
    models = _models()
    assert models["llama"].config._attn_implementation == HF_ATTENTION
    tokens = torch.randint(0, 64, (2, 32))
    for name, model in models.items():
        torch.testing.assert_close(_under_cp(model, tokens, staged=staged), _logits(model, {"input_ids": tokens}),
                                   rtol=0, atol=1e-5, msg=name)


@torch.no_grad()
def test_a_packed_window_of_three_documents_under_cp2_equals_each_document_alone():
    """The mask of the global document ids (each rank takes them from the whole window before the cut): the window's
    logits of each document equal that document run alone; the cut's positions restart at each document."""
    eos, lengths = 1, (9, 15, 8)
    torch.manual_seed(1)
    documents = [torch.cat([torch.randint(2, 64, (n - 1,)), torch.tensor([eos])]) for n in lengths]
    window = torch.cat(documents)[None]
    inputs = packed_inputs(window, eos)
    for name, model in _models().items():
        whole, start = _under_cp(model, inputs), 0
        for document in documents:
            alone = _logits(model, {"input_ids": document[None]})
            torch.testing.assert_close(whole[:, start:start + len(document)], alone, rtol=0, atol=1e-5, msg=name)
            start += len(document)
        unmasked = _under_cp(model, window)  # the same window without documents: the later ones see the first
        assert (unmasked[:, lengths[0]:] - whole[:, lengths[0]:]).abs().max() > 1e-3, name


@torch.no_grad()
def test_a_packed_window_of_three_documents_through_two_pipeline_stages_equals_each_document_alone():
    """pp 2 without cp: the stages take the step's positions (each microbatch's rows) and mask by their documents, as
    the whole model does; with cp 2 too, the step's cut of them (each microbatch's rows of the mask)."""
    eos, lengths = 1, (9, 15, 8)
    torch.manual_seed(1)
    documents = [torch.cat([torch.randint(2, 64, (n - 1,)), torch.tensor([eos])]) for n in lengths]
    window = torch.cat(documents)[None]
    inputs = packed_inputs(torch.cat([window, window.flip(1)]), eos)  # two windows: a microbatch each
    for name, model in _models().items():
        for whole in (_staged(model, 2)(**inputs), _under_cp(model, inputs, staged=2)):
            start = 0
            for document in documents:
                alone = _logits(model, {"input_ids": document[None]})
                torch.testing.assert_close(whole[:1, start:start + len(document)], alone, rtol=0, atol=1e-5, msg=name)
                start += len(document)
            torch.testing.assert_close(whole[1:], _logits(model, {key: rows[1:] for key, rows in inputs.items()}),
                                       rtol=0, atol=1e-5, msg=name)  # the second microbatch: its own window's
        causal = _staged(model)(input_ids=window, position_ids=torch.arange(32)[None])  # one document
        assert (causal - _staged(model)(**inputs)[:1]).abs().max() > 1e-3, name  # the later ones see the first
