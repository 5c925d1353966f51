"""Hugging Face mixtures of experts in one process: a Mixtral and a Qwen3-MoE saved by save_pretrained (the Hub's
per-expert tensors) read by model.init_from through transformers' own conversion into their fused experts, exactly as
from_pretrained reads them; rank 1 of fsdp 2 (a fake process group) reads only its experts; weights/ keeps the fused
names and loads with from_pretrained; the router's aux loss is counted once; which families expert parallel takes
(find_experts), the others in one line; and LoRA on the fused experts: split with them under expert parallel (each
rank adds its experts' delta), merged into weights/merged/ (one process and a rank's fsdp block), which loads as the
trained model."""

from __future__ import annotations

import pytest
import torch

from distrib.checkpoint.init_from import check_weights, load_weights, open_source
from distrib.checkpoint.pretrained_sources import Safetensors
from distrib.checkpoint.weights import hf_config, model_tensors, save_weights
from distrib.distributed.expert_modules import find_experts
from distrib.errors import ConfigError, UserError
from tests.helpers.pretrained import llama, lora_moe, mixtral, moe_from_pretrained, qwen3_moe, save_moe
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
        found = find_experts(build(), 2)
        assert list(found) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], family
        assert all(experts.fused and experts.num_experts == 4 for experts in found.values()), family
    with torch.device("meta"):
        switch = Switch(SwitchTransformersConfig(
            vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4,
            num_sparse_encoder_layers=1, num_sparse_decoder_layers=1))
        dbrx = DbrxForCausalLM(DbrxConfig(d_model=32, n_heads=4, n_layers=1, max_seq_len=16, vocab_size=64,
                                          attn_config=dict(kv_n_heads=2, rope_theta=1e4),
                                          ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2)))
    refused = {"per-expert modules": (switch, 2, "encoder.block.1.layer.1.mlp.experts (SwitchTransformersExperts) "
                                                "holds its 4 experts as per-expert modules, not fused tensors"),
               "not experts-first": (dbrx, 2, "holds mlp.w1 [64, 32], not experts-first ([4, ...])"),
               "no experts": (llama(), 2, "the model (LlamaForCausalLM) has no experts to split"),
               "not a divisor": (mixtral(), 3, "model.layers.0.mlp.experts holds 4 experts, which 3 ranks cannot "
                                               "split evenly; use a divisor of 4 (1, 2, 4)")}
    for case, (model, degree, says) in refused.items():
        with pytest.raises(ConfigError) as error:
            find_experts(model, degree)
        assert "\n" not in str(error.value) and str(error.value).startswith(f"dist.expert_parallel = {degree}: ")
        assert says in str(error.value), (case, str(error.value))


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_expert_parallel_dispatch_on_one_rank_gives_transformers_forward(family, implementation):
    """distrib's dispatch of transformers' fused experts (pairs sorted by expert, the contract's route, the module's
    own forward on local ids, then the router's weights) on an ep group of 1 (a world-1 gloo group): the logits,
    loss and every gradient of the model as transformers computes them, to float rounding."""
    torch.manual_seed(0)
    _dispatched_like_one_process(FAMILIES[family], implementation)


def _dispatched_like_one_process(build, implementation: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from distrib.distributed.expert_parallel import apply_expert_parallel

    reference = build()
    dispatched = build()
    dispatched.load_state_dict(reference.state_dict())
    for model in (reference, dispatched):
        model.config._experts_implementation = implementation
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert len(apply_expert_parallel(dispatched, init_device_mesh("cpu", (1,)))) == 2
        expected, got = reference(input_ids=ids, labels=ids), dispatched(input_ids=ids, labels=ids)
        expected.loss.backward()
        got.loss.backward()
    finally:
        dist.destroy_process_group()
    assert torch.allclose(got.logits, expected.logits, atol=1e-6) and torch.allclose(got.loss, expected.loss)
    for (name, param), mine in zip(reference.named_parameters(), dispatched.parameters()):
        grad = mine.grad.to_local() if hasattr(mine.grad, "to_local") else mine.grad
        assert (grad is None) == (param.grad is None) == (not param.requires_grad), name  # a frozen base: none
        assert grad is None or torch.allclose(grad, param.grad, atol=1e-6), name


EXPERT_TARGETS = "q_proj,gate_proj,up_proj,down_proj"  # peft puts the last three on the fused experts (ParamWrapper)


def _lora_on_experts(folder):
    """A Qwen3-MoE from `folder` with LoRA on its attention's q_proj and on its experts, the adapter made non-zero as
    training makes it."""
    from distrib.checkpoint.init_from import load_weights as read_weights

    torch.manual_seed(0)
    model = lora_moe(str(folder), targets=EXPERT_TARGETS)
    read_weights(model, check_weights(model, open_source(str(folder))))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.2)
    return model.eval()


def test_lora_on_the_experts_is_split_with_them_each_rank_adding_its_experts_delta(tmp_path):
    """find_experts sees through peft's wrappers (the fused module inside, its two ParamWrappers outermost first);
    the rank holding experts 2 and 3 of 4 adds to them their rows of peft's delta (ParamWrapper.get_delta_weight); on
    an ep group of one rank the dispatch is peft's forward and backward, adapter gradients included."""
    from peft.tuners.lora import ParamWrapper

    from distrib.distributed.hf_expert_parallel import _adapted

    folder = save_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    model = _lora_on_experts(folder)
    experts = find_experts(model, 2)["base_model.model.model.layers.0.mlp.experts"]
    assert type(experts.module).__name__ == "Qwen3MoeExperts" and experts.num_experts == 4 and experts.fused
    assert [type(a) for a in experts.adapters] == [ParamWrapper] * 2
    assert {a.parameter_name for a in experts.adapters} == {"gate_up_proj", "down_proj"}
    module, whole = experts.module, dict(experts.module._parameters)
    try:
        with torch.no_grad():
            module._parameters.update({name: tensor[2:] for name, tensor in whole.items()})  # rank 1 of ep 2's
            _adapted(module, experts.adapters, 2)
            for adapter in experts.adapters:
                name = adapter.parameter_name
                expected = whole[name] + adapter.get_delta_weight("default")
                assert torch.allclose(module._parameters[name], expected[2:], atol=1e-6), name
    finally:
        module._parameters.update(whole)
    _dispatched_like_one_process(lambda: _lora_on_experts(folder), "grouped_mm")


def test_an_adapter_expert_parallel_cannot_split_is_refused_in_one_line():
    from peft import LoraConfig, get_peft_model

    from distrib.models.gpt import GPT

    gpt = get_peft_model(GPT(n_layers=1, n_heads=2, dim=16, n_experts=4, top_k=2),
                         LoraConfig(r=2, target_parameters=["experts.w1"]))
    with pytest.raises(ConfigError) as error:
        find_experts(gpt, 2)
    assert str(error.value).startswith(
        "dist.expert_parallel = 2: PeftModel's base_model.model.layers.0.moe.experts (GroupedExperts) carries a LoRA "
        "adapter, which expert parallel splits with the experts of transformers' fused ones only;")


def test_lora_on_the_experts_is_merged_into_merged_which_loads_as_the_trained_model(tmp_path):
    """weights/merged/ of a LoRA on the fused experts (peft's ParamWrapper: an A and a B per expert), as a user loads
    it with from_pretrained: the wrapped model's logits (the base's are 0.8 away)."""
    from distrib.checkpoint.adapter_weights import MERGED_DIR
    from distrib.checkpoint.run_weights import write_run_weights
    from distrib.checkpoint.weight_files import WEIGHTS_DIR
    from distrib.distributed.strategies.ddp import DDPStrategy

    folder = save_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    model = _lora_on_experts(folder)
    lines = []
    write_run_weights(model, None, tmp_path / "run", 0, DDPStrategy(), str(folder), True, lines.append)
    assert f"; {MERGED_DIR}/: the merged model (from_pretrained)" in lines[-1], lines
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        merged = moe_from_pretrained(str(tmp_path / "run" / WEIGHTS_DIR / MERGED_DIR)).eval()(input_ids=ids).logits
        base = moe_from_pretrained(str(folder)).eval()(input_ids=ids).logits
    assert (merged - trained).abs().max() < 1e-5 < 0.1 < (base - trained).abs().max()


def test_a_rank_of_fsdp_merges_the_lora_of_its_own_experts(tmp_path):
    """Rank 1 of fsdp 2 (a fake process group) holds experts 2 and 3 of each fused tensor: its merged block is those
    experts of the one-process merge, made from the whole (small) A and B."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distrib.checkpoint.adapter_weights import adapter_state, merged_tensors
    from distrib.checkpoint.weights import model_tensors

    folder = save_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    model = _lora_on_experts(folder)
    whole = adapter_state(model)
    reference, why = merged_tensors(model, model_tensors(model), whole)
    assert why is None
    with fake_rank(1, 2):
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        merged, why = merged_tensors(model, model_tensors(model), whole)
        assert why is None and merged.keys() == reference.keys()
        for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            assert merged[name].to_local().shape[0] == 2
            assert torch.equal(merged[name].to_local(), reference[name][2:]), name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_transformers_moes_load_is_its_routers_choices_counted_once_per_training_forward(family):
    """ExpertLoad counts the (token, choice) pairs each experts module is called with: those of the router's top-k
    of the logits transformers returns (output_router_logits), training forwards only (not an evaluation's, not
    gradient checkpointing's recompute), and names the layout in one line."""
    from types import SimpleNamespace

    from distrib.distributed.mesh import ParallelDims
    from distrib.training.experts import ExpertLoad

    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.gradient_checkpointing_enable()  # the recompute runs the experts' forward again, in the backward
    load = ExpertLoad.of(model, SimpleNamespace(dims=ParallelDims(1, 1)), torch.device("cpu"))
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)  # an evaluation's forward: not counted
    load.start(micro_steps=1)
    outputs = model.train()(input_ids=ids, labels=ids)
    outputs.loss.backward()
    load.after_step(log=True)
    chosen = [torch.topk(logits, 2, dim=-1).indices.flatten() for logits in outputs.router_logits]
    assert load.counts.tolist() == [torch.bincount(c, minlength=4).double().tolist() for c in chosen]
    assert load.counts.sum().item() == 2 * 3 * 16 * 2  # layers x tokens x top_k
    counts = load.counts
    assert load.logged() == {"expert_imbalance": pytest.approx((counts.max(1).values / counts.mean(1)).max().item()),
                             "dropped_tokens": 0.0}
    assert load.describe(ParallelDims(1, 4, expert_parallel=2)) == \
        "experts: 2 MoE layers of 4 experts (top 2); expert parallel 2 x fsdp 2: 2 of 4 experts per rank"


@pytest.mark.parametrize("factory", ["qwen3_moe", "lora_moe"])
def test_plan_and_its_dry_run_count_the_experts_of_a_transformers_moe_fed_dict_samples(tmp_path, factory, capsys):
    """distrib plan of a Qwen3-MoE (and it under peft's LoRA on q_proj and its fused experts) from a safetensors
    folder, with dict samples (input_ids, attention_mask, labels) from a data factory: its passes take the data's own
    structure (not a float batch), peft's fold of the experts' LoRA runs on meta (its autocast of the meta device),
    and each rank's expert bytes are its 1/4 of the fused experts and of their adapters (ep 2 x fsdp 2)."""
    import json

    from distrib.cli import main
    from tests.helpers.support import sets

    folder = save_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    targets = "q_proj,gate_proj,up_proj,down_proj"
    kwargs = [f'model.kwargs={{folder = "{folder}", targets = "{targets}"}}'] if factory == "lora_moe" else []
    argv = sets(f"model.factory=tests.helpers.pretrained:{factory}", *kwargs, f"model.init_from={folder}",
                "data.factory=tests.helpers.pretrained:token_dicts", "dist.device=cpu", "dist.strategy=fsdp",
                "dist.expert_parallel=2", "train.global_batch_size=16", "train.optimizer=adamw")
    assert main(["plan", *argv, "--world-size", "4", "--dry-run", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    model = lora_moe(str(folder), targets=targets) if factory == "lora_moe" else qwen3_moe()
    experts = [p for name, p in model.named_parameters() if ".experts." in name]  # LoRA's A and B among them
    trained = [p for p in experts if p.requires_grad]
    assert len(trained) == (8 if factory == "lora_moe" else len(experts))  # A and B of 2 fused tensors x 2 layers
    held = 4 * sum(p.numel() for p in experts) // 4  # fp32, a rank's 1/4 of each (the adapters split with them)
    assert figures["moe_layers_per_rank"] == 2 and figures["expert_parallel"] == 2
    assert figures["expert_parameter_bytes_per_rank"] == held
    # trained: gradients, AdamW's two moments and a step count per tensor; frozen under LoRA: none of them
    assert figures["expert_state_bytes_per_rank"] == held + 3 * sum(p.numel() for p in trained) + 4 * len(trained)
    assert figures["all_to_all_bytes_per_step_intra_node"] > 0 and figures["activation_bytes_per_micro_batch"] > 0
    assert figures["dry_run_peak_bytes_per_rank"] > 0 and figures["dry_run_activations_bytes"] > 0


def test_the_ddp_dry_run_of_lora_on_a_moe_s_experts_measures_the_adapters_state_alone(tmp_path, capsys):
    """Under ddp (torch's MemTracker, which hooks every parameter's gradient) the frozen base weights, which refuse
    gradient hooks, are measured without gradients: the dry run ends 0, and its optimizer state and DDP's buckets at
    the peak are those of the adapters, LoRA's A and B of q_proj and of the fused experts, whole on each rank."""
    import json

    from distrib.cli import main
    from tests.helpers.support import sets

    folder = save_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    targets = "q_proj,gate_proj,up_proj,down_proj"
    argv = sets("model.factory=tests.helpers.pretrained:lora_moe", f"model.init_from={folder}",
                f'model.kwargs={{folder = "{folder}", targets = "{targets}"}}',
                "data.factory=tests.helpers.pretrained:token_dicts", "dist.device=cpu", "dist.strategy=ddp",
                "train.global_batch_size=16", "train.optimizer=adamw")
    assert main(["plan", *argv, "--world-size", "4", "--dry-run", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    trained = [p for p in lora_moe(str(folder), targets=targets).parameters() if p.requires_grad]
    assert len(trained) == 2 * 3 * 2  # A and B of q_proj, gate_up_proj and down_proj, in 2 layers
    trained_bytes = 4 * sum(p.numel() for p in trained)
    assert figures["dry_run_ddp_buckets_bytes"] == trained_bytes
    assert figures["dry_run_optimizer_bytes"] == 2 * trained_bytes + 4 * len(trained)  # AdamW's moments, step counts


def test_plan_under_pipeline_parallel_refuses_dict_samples_in_one_line(capsys):
    from distrib.cli import main
    from tests.helpers.support import sets

    argv = sets("model.factory=tests.helpers.pretrained:qwen3_moe", "data.factory=tests.helpers.pretrained:token_dicts",
                "dist.device=cpu", "dist.strategy=fsdp", "dist.pipeline_parallel=2", "train.global_batch_size=16")
    assert main(["plan", *argv, "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dist.pipeline_parallel = 2: the data's micro-batches are dict samples " \
                                     "({input_ids: int64 [8, 16], " in err
    assert "which cannot be cut into microbatches" in err
