"""Hugging Face mixtures of experts in one process: a Mixtral and a Qwen3-MoE saved by save_pretrained (the Hub's
per-expert tensors) read by model.init_from through transformers' own conversion into their fused experts, exactly as
from_pretrained reads them; rank 1 of fsdp 2 (a fake process group) reads only its experts; weights/ keeps the fused
names and loads with from_pretrained; the router's aux loss is counted once; and which families expert parallel takes
(hf_experts), the others in one line."""

from __future__ import annotations

import pytest
import torch

from distrib.checkpoint.init_from import Safetensors, check_weights, load_weights, open_source
from distrib.checkpoint.weights import hf_config, model_tensors, save_weights
from distrib.distributed.hf_experts import hf_experts
from distrib.errors import ConfigError, UserError
from tests.helpers.pretrained import llama, mixtral, moe_from_pretrained, qwen3_moe, save_moe
from tests.helpers.support import fake_rank

FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_hubs_per_expert_layout_loads_as_from_pretrained_loads_it(tmp_path, family):
    folder = save_moe(tmp_path / family, family)
    model = FAMILIES[family]()
    source = open_source(str(folder))
    assert any(".experts.0." in name for name in source.shapes)  # per expert in the files, fused in the model
    note = load_weights(model, check_weights(model, source))
    assert "through transformers' checkpoint conversion" in note
    assert _equal(model.state_dict(), moe_from_pretrained(str(folder)).state_dict())


def test_rank_1_of_fsdp_2_reads_only_its_experts(tmp_path, monkeypatch):
    """The fused experts are sharded on dim 0 (the experts): rank 1 reads experts 2 and 3 of each layer, never 0
    and 1, and half of every other tensor's rows: half of the bytes in all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    folder = save_moe(tmp_path / "mixtral")
    reference = moe_from_pretrained(str(folder)).state_dict()
    read = {}
    real_read = Safetensors.read
    monkeypatch.setattr(Safetensors, "read", lambda self, name, slices: read.setdefault(name, real_read(
        self, name, slices)))
    with fake_rank(1, 2):
        mesh = init_device_mesh("cpu", (2,))
        model = mixtral()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        load_weights(model, check_weights(model, open_source(str(folder))))
        for name, tensor in model.state_dict().items():
            half = reference[name].shape[0] // 2
            assert torch.equal(tensor.to_local(), reference[name][half:]), name
    experts = sorted({name.split(".experts.")[1].split(".")[0] for name in read if ".experts." in name})
    assert experts == ["2", "3"]
    assert 2 * sum(t.numel() for t in read.values()) == sum(t.numel() for t in reference.values())


def test_another_sized_mixture_of_experts_is_refused_under_the_models_names(tmp_path):
    folder = str(save_moe(tmp_path / "mixtral"))
    with pytest.raises(UserError) as more_experts:
        check_weights(mixtral(num_local_experts=8), open_source(folder))
    message = str(more_experts.value)
    assert "\n" not in message and "6 mis-shaped (first model.layers.0.mlp.gate.weight: [4, 64] in the weights, " \
                                    "[8, 64] in the model)" in message


def test_weights_keep_the_fused_names_and_load_with_from_pretrained_and_init_from(tmp_path):
    model = mixtral()
    tensors = model_tensors(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_weights(tensors, tmp_path / "weights", 0, hf_config(model), max_file_bytes=200_000)
    assert _equal(moe_from_pretrained(str(tmp_path / "weights")).state_dict(), model.state_dict())
    again = mixtral()
    source = open_source(str(tmp_path / "weights"))
    note = load_weights(again, check_weights(again, source))
    assert "conversion" not in note and _equal(again.state_dict(), model.state_dict())


def test_the_routers_aux_loss_is_in_the_models_loss_once():
    """transformers adds router_aux_loss_coef x aux_loss into outputs.loss: distrib trains outputs.loss as it is and
    only logs aux_loss (it joins the backward only beside a built-in loss, which has no aux loss in it)."""
    import torch.nn.functional as F

    from distrib.training.extra_losses import ExtraLosses
    from distrib.training.losses import model_loss

    model = mixtral().eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    outputs = model(input_ids=ids, labels=ids)
    cross_entropy = F.cross_entropy(outputs.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert outputs.aux_loss > 0
    assert torch.allclose(outputs.loss, cross_entropy + model.config.router_aux_loss_coef * outputs.aux_loss)
    extras = ExtraLosses.of(outputs, model_loss(outputs, ids))
    assert extras.names == ("aux_loss",) and not extras.added


def test_expert_parallel_takes_fused_experts_first_families_and_refuses_others_in_one_line():
    from transformers import DbrxConfig, DbrxForCausalLM, SwitchTransformersConfig
    from transformers import SwitchTransformersForConditionalGeneration as Switch

    for family, build in FAMILIES.items():
        assert list(hf_experts(build(), 2)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], family
    with torch.device("meta"):
        switch = Switch(SwitchTransformersConfig(
            vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
            num_sparse_encoder_layers=1, num_sparse_decoder_layers=1))
        dbrx = DbrxForCausalLM(DbrxConfig(d_model=32, n_heads=4, n_layers=1, max_seq_len=16, vocab_size=64,
                                          attn_config=dict(kv_n_heads=2, rope_theta=1e4),
                                          ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2)))
    refused = {"per-expert modules": (switch, 2, "holds its experts as per-expert modules (encoder.block.1.layer.1"
                                                ".mlp.experts: a SwitchTransformersExperts of 4)"),
               "not experts-first": (dbrx, 2, "holds mlp.w1 [64, 32], not experts-first ([4, ...])"),
               "no experts": (llama(), 2, "has no experts module"),
               "not a divisor": (mixtral(), 3, "holds 4 experts, which the degree does not divide")}
    for case, (model, degree, says) in refused.items():
        with pytest.raises(ConfigError) as error:
            hf_experts(model, degree)
        assert "\n" not in str(error.value) and str(error.value).startswith(f"dist.expert_parallel = {degree}: ")
        assert says in str(error.value), (case, str(error.value))


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_expert_parallel_dispatch_on_one_rank_gives_transformers_forward(family, implementation):
    """distrib's dispatch of transformers' fused experts (pairs sorted by expert, the contract's route, the module's
    own forward on local ids, then the router's weights) on an ep group of 1 (a world-1 gloo group): the logits,
    loss and every gradient of the model as transformers computes them, to float rounding."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from distrib.distributed.hf_expert_parallel import apply_hf_expert_parallel

    torch.manual_seed(0)
    reference = FAMILIES[family]()
    dispatched = FAMILIES[family]()
    dispatched.load_state_dict(reference.state_dict())
    for model in (reference, dispatched):
        model.config._experts_implementation = implementation
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert len(apply_hf_expert_parallel(dispatched, init_device_mesh("cpu", (1,)))) == 2
        expected, got = reference(input_ids=ids, labels=ids), dispatched(input_ids=ids, labels=ids)
        expected.loss.backward()
        got.loss.backward()
    finally:
        dist.destroy_process_group()
    assert torch.allclose(got.logits, expected.logits, atol=1e-6) and torch.allclose(got.loss, expected.loss)
    for (name, param), mine in zip(reference.named_parameters(), dispatched.parameters()):
        grad = mine.grad.to_local() if hasattr(mine.grad, "to_local") else mine.grad
        assert torch.allclose(grad, param.grad, atol=1e-6), name
