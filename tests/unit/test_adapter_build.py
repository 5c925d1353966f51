"""A peft LoRA adapter built as every strategy builds it, in one process: model.init_from's base weights fill the
wrapped model (its base layers under the base model's names), the adapter keeps peft's initialisation, bitwise the
same whether the model was built whole (ddp) or on the meta device and materialised (fsdp, hsdp), so its first logits
are the base model's; and a factory that calls from_pretrained under a sharded strategy is one line naming the fix."""

from __future__ import annotations

import pytest
import torch

from distrib.checkpoint.init_from import check_weights, open_source
from distrib.config import load_config
from distrib.distributed.strategies import materialise
from distrib.errors import UserError
from distrib.training.building import init_from
from tests.helpers.pretrained import lora_from_pretrained, lora_llama, save_llama


def _built(folder, on_meta: bool, notes: list[str]):
    """lora_llama filled by the worker's model.init_from hook, built whole (ddp) or as fsdp builds it for loading."""
    config = load_config(None, [f"model.init_from={folder}", "train.seed=3"])
    if on_meta:
        model, buffers = materialise.build_for_loading(lora_llama, seed=3)
        model.to_empty(device="cpu")
        materialise.restore_buffers(model, buffers)
    else:
        model = materialise.build_whole(lora_llama, seed=3)
    init_from(config, notes)(model)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_base_weights_fill_the_wrapped_model_and_the_adapter_keeps_peft_init_under_every_build(tmp_path):
    from transformers import LlamaForCausalLM

    folder = save_llama(tmp_path / "base")
    notes = []
    whole, materialised = _built(folder, False, notes), _built(folder, True, notes)
    adapter = {name: tensor for name, tensor in whole.state_dict().items() if "lora_" in name}
    assert len(adapter) == 8 and all(torch.equal(tensor, materialised.state_dict()[name])
                                      for name, tensor in adapter.items())
    assert all(not tensor.any() for name, tensor in adapter.items() if "lora_B" in name)
    assert all(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_A" in name)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    base = _logits(LlamaForCausalLM.from_pretrained(folder), ids)
    assert torch.equal(_logits(whole, ids), base) and torch.equal(_logits(materialised, ids), base)
    assert "the adapter's 8 tensors" in notes[0] and "keep the adapter's own initialisation" in notes[0]


def test_the_adapters_tensors_are_the_only_ones_the_base_weights_do_not_name(tmp_path):
    folder = save_llama(tmp_path / "base")
    checked = check_weights(lora_llama(), open_source(str(folder)))
    assert sorted(checked.kept) == sorted(name for name in lora_llama().state_dict() if "lora_" in name)
    assert checked.names["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == \
        "model.layers.0.self_attn.q_proj.weight"


def test_from_pretrained_in_a_factory_under_a_sharded_strategy_names_model_init_from(tmp_path):
    from distrib.factory import call_factory

    folder = save_llama(tmp_path / "base")

    def factory():
        return call_factory("model.factory", "tests.helpers.pretrained:lora_from_pretrained", lora_from_pretrained,
                            {"folder": str(folder)})

    with pytest.raises(UserError) as refused:
        materialise.build_on_meta(factory, seed=0)
    said = str(refused.value)
    assert said.startswith("model.factory = 'tests.helpers.pretrained:lora_from_pretrained': calls from_pretrained")
    assert "--set model.init_from=FOLDER" in said and "\n" not in said
