"""FLOPs per sample counted once on the whole model, as every strategy and world size counts them: a copy on the meta
device whose weights hold one zero each, run on the real batch (an MoE's top-k experts, frozen weights with no
weight-gradient matmul, the built-in GPT's own count beside the counter's), and nothing of the run touched."""

import resource

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distrib.models.gpt import GPT
from distrib.training.throughput import count_flops_per_sample, flops_per_sample, whole_on_meta
from tests.helpers import moe
from tests.helpers.pretrained import lora_llama
from tests.helpers.support import fake_rank


def _lm_loss(outputs, targets):
    logits = outputs["logits"] if isinstance(outputs, dict) else outputs
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _moe_flops(tokens: int, dim: int, experts: int, layers: int, vocab: int) -> int:
    """tests/helpers/moe.py's top-1 MoE by hand: per token and layer the qkv, output, router and ONE expert's two
    matrices (2 x 8 dim^2 + 2 x dim x experts), then the head; every weight trainable and the embeddings too, so the
    backward is twice the forward. Attention as torch counts it: forward 4 x T^2 x dim per layer, and its backward
    2.5 times that (a fused attention recomputes the scores)."""
    matmuls = tokens * (layers * 2 * (8 * dim * dim + dim * experts) + 2 * dim * vocab)
    return 3 * matmuls + 14 * tokens * tokens * dim * layers


def test_an_moe_counts_its_top_k_experts_the_same_whole_or_as_fsdp_holds_it():
    ids = torch.randint(0, moe.VOCAB, (2, moe.SEQ_LEN))
    expected = _moe_flops(moe.SEQ_LEN, dim=16, experts=moe.NUM_EXPERTS, layers=2, vocab=moe.VOCAB)
    model = moe.moe_lm()
    assert count_flops_per_sample(model, ids, ids, _lm_loss) == expected  # the real weights, whole: ddp's model
    on_meta = whole_on_meta(moe.moe_lm)
    assert all(p.is_meta for p in on_meta.parameters())
    assert count_flops_per_sample(on_meta, ids, ids, _lm_loss) == expected
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with fake_rank(0, 2):  # a module given to distrib.fit, copied before fsdp shards it in place
        copied = whole_on_meta(None, given=model)
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        assert isinstance(model.head.weight, DTensor) and model.head.weight.to_local().shape[0] == moe.VOCAB // 2
        assert count_flops_per_sample(copied, ids, ids, _lm_loss) == expected


def test_frozen_weights_count_no_weight_gradient_matmul():
    a, b, c = 8, 16, 4
    inputs, targets = torch.randn(5, a), torch.randint(0, c, (5,))
    model = nn.Sequential(nn.Linear(a, b), nn.Linear(b, c))
    # forward 2ab + 2bc; backward: the second layer's weight and input gradients, the first's weight gradient (the
    # inputs want none)
    assert count_flops_per_sample(model, inputs, targets) == 4 * a * b + 6 * b * c
    model[1].weight.requires_grad_(False)  # its input gradient still flows to the first layer
    assert count_flops_per_sample(model, inputs, targets) == 4 * a * b + 4 * b * c
    model[0].requires_grad_(False)
    model[1].weight.requires_grad_(True)
    assert count_flops_per_sample(model, inputs, targets) == 2 * a * b + 4 * b * c


def test_a_lora_model_counts_on_meta_what_it_counts_whole_and_less_than_full_fine_tuning():
    ids = torch.randint(0, 256, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    model = lora_llama()
    lora = count_flops_per_sample(model, batch, ids, _lm_loss)  # a Hugging Face model: its mask check reads values
    assert lora == count_flops_per_sample(whole_on_meta(lora_llama), batch, ids, _lm_loss)
    full = whole_on_meta(lora_llama).requires_grad_(True)
    assert lora < 0.75 * count_flops_per_sample(full, batch, ids, _lm_loss)


@pytest.mark.parametrize("kwargs", [{}, {"tie_weights": False}, {"dim": 256, "n_layers": 2, "seq_len": 64}])
def test_the_gpts_own_count_is_within_4_percent_of_the_counter(kwargs):
    """The same products: the counter adds the scores a fused attention's backward recomputes (a sixth of the
    attention's FLOPs), and leaves out the norms' weights, which the 6 x parameters rule counts."""
    model = whole_on_meta(lambda: GPT(**kwargs))
    tokens = torch.randint(0, 256, (2, model.seq_len))
    own = flops_per_sample(model, tokens, tokens, _lm_loss)
    assert own == model.flops_per_token(model.seq_len) * model.seq_len
    counted = count_flops_per_sample(model, tokens, tokens, _lm_loss)
    assert 1 <= counted / own < 1.04


def test_the_count_is_side_effect_free():
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.Linear(16, 4)).train()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    inputs, targets = torch.randn(6, 8), torch.randint(0, 4, (6,))
    rng = torch.get_rng_state()
    assert count_flops_per_sample(model, inputs, targets) == 3 * 2 * 16 * 4 + 2 * 2 * 8 * 16
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


class _LargeFrozenTable(nn.Module):
    """A 2 GiB frozen embedding table under a small trainable head."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(1 << 23, 64).requires_grad_(False), nn.Linear(64, 4)

    def forward(self, ids):
        return self.head(self.embed(ids)).mean(1)


def test_the_counted_copy_holds_one_value_per_weight():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    ids, targets = torch.randint(0, 1 << 23, (2, 8)), torch.randint(0, 4, (2,))
    # the head's forward, weight gradient and nothing else (the table wants no gradient): 8 tokens x 2 x 64 x 4 x 2
    assert count_flops_per_sample(whole_on_meta(_LargeFrozenTable), ids, targets) == 8 * 2 * 64 * 4 * 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # the table never made

def test_a_factory_that_cannot_build_on_meta_leaves_the_count_to_the_placed_model():
    def reads_values():
        model = nn.Linear(2, 2)
        model.scale = float(model.weight.detach().sum())  # a value: none on meta
        return model

    assert whole_on_meta(reads_values) is None
