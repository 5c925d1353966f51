"""Adapters (a `peft` PeftModel: LoRA and its kin): which of a wrapped model's tensors are the adapter's and which the
base model's, under the base model's own names. peft is imported only for a model that is already one of its own.

    base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight  ->  model.layers.0.self_attn.q_proj.weight
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight  ->  the adapter's (None)
"""

from __future__ import annotations

import torch.nn as nn

_WRAPPED = "base_model.model."  # PeftModel -> its tuner (LoraModel) -> the user's model
_LAYER = ".base_layer"  # the base layer a tuner layer wraps
_ORIGINAL = ".original_module"  # modules_to_save: the base copy kept frozen beside the trained one


def is_peft(model: nn.Module) -> bool:
    """Whether the model is a peft PeftModel (a class of peft's, also under FSDP2's subclass, with adapter configs)."""
    return hasattr(model, "peft_config") and any(cls.__module__.startswith("peft.") for cls in type(model).__mro__)


def _prefix(model: nn.Module) -> str:
    """The tuner's marker in its adapter tensors' names (LoRA's `lora_`)."""
    return getattr(model.base_model, "prefix", "lora_")


def is_adapter_name(model: nn.Module, name: str) -> bool:
    """Whether a state_dict name of the PeftModel is one of the adapter's tensors (not in the base model's weights)."""
    return _prefix(model) in name or ".modules_to_save." in name or name.startswith("prompt_encoder.")


def base_name(model: nn.Module, name: str) -> str | None:
    """The base model's name of a PeftModel's state_dict entry, or None for an adapter tensor."""
    if is_adapter_name(model, name):
        return None
    return name.removeprefix(_WRAPPED).replace(_LAYER, "").replace(_ORIGINAL, "")


def base_model(model: nn.Module) -> nn.Module:
    """The user's model inside a PeftModel (its tuner layers injected), or the model itself."""
    return model.get_base_model() if is_peft(model) else model


def adapter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each tuner layer that owns adapter weights and can initialise them (LoRA's LoraLayer)."""
    return [(name, module) for name, module in model.named_modules()
            if callable(getattr(module, "reset_lora_parameters", None)) and getattr(module, "lora_A", None)]


def reset_adapters(model: nn.Module) -> int:
    """Every adapter's weights initialised as peft initialises them (its config's init_lora_weights: LoRA's A by
    Kaiming-uniform, B zeros, so that the wrapped model starts equal to the base). Returns the layers reset."""
    layers = adapter_layers(model)
    for _, layer in layers:
        for adapter in layer.lora_A:
            layer.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)
    return len(layers)
