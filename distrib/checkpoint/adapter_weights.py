"""An adapter run's weights: the adapter in peft's own format (what PeftModel.from_pretrained and transformers'
from_pretrained load), and the merged model (each LoRA delta added to its base weight) under the base model's names.

    run.dir/weights/
        adapter_model.safetensors, adapter_config.json   the adapter "default" (another one in weights/NAME/)
        merged/                                          model.safetensors (or several) and the base's config.json
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from distrib.checkpoint.blocks import block_slices, local_block, local_part
from distrib.checkpoint.export_check import (
    agree_checked,
    architecture,
    check_adapter_folder,
    check_folder,
    check_pretrained_folder,
)
from distrib.checkpoint.weight_files import ADAPTER_FILE, MAX_FILE_BYTES, WEIGHTS_DIR, agree_write, write_fault
from distrib.checkpoint.weights import hf_config, replace_folder, save_weights
from distrib.distributed.hf_experts import lora_delta
from distrib.models.adapters import base_name, is_adapter_name

ADAPTER_CONFIG, MERGED_DIR = "adapter_config.json", "merged"
_WRAPPED = "base_model.model."
_MERGE_YOURSELF = "PeftModel.from_pretrained(base, weights/).merge_and_unload() merges it"


def base_path(init_from: str) -> str | None:
    """What adapter_config.json names as the base: model.init_from's folder or file, absolute (a distrib run
    directory: its weights/, the safetensors folder that init_from read), or None when it is not set."""
    if not init_from:
        return None
    path = Path(init_from).resolve()
    return str(path / WEIGHTS_DIR if (path / WEIGHTS_DIR).is_dir() else path)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank (a collective under fsdp and hsdp): the adapter's tensors only, each whole on the host (a DTensor's
    full_tensor, in state_dict order, so every rank gathers the same tensors in the same order)."""
    state = model.state_dict()  # FSDP2: each rank's shards, nothing gathered
    whole = {}
    for name, tensor in state.items():
        if is_adapter_name(model, name):
            tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            whole[name] = tensor.detach().to("cpu", copy=True)  # copies: safetensors refuses shared storage
    return whole


def write_adapter(model: nn.Module, whole: dict[str, torch.Tensor], folder: Path, base: str | None) -> None:
    """Rank 0: each adapter's files as PeftModel.save_pretrained writes them ("default" in `folder`, another in
    folder/NAME), with base_model_name_or_path = `base`."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    for adapter, config in model.peft_config.items():
        out = folder if adapter == "default" else folder / adapter
        out.mkdir(parents=True, exist_ok=True)
        # save_embedding_layers=False: "auto" may ask the Hub; distrib never resizes a vocabulary, so the base's
        # embeddings are the ones trained on
        state = get_peft_model_state_dict(model, state_dict=whole, adapter_name=adapter, save_embedding_layers=False)
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(out / ADAPTER_FILE),
                  metadata={"format": "pt"})
        config = copy.deepcopy(config)
        config.base_model_name_or_path = base
        config.inference_mode = True
        mapping = None
        if config.task_type is None:  # as save_pretrained: which class the base is, for PeftModel's auto classes
            cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
            mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
        config.save_pretrained(str(out), auto_mapping_dict=mapping)


# ---------------------------------------------------------------- the merged model


def _lora_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], str | None]:
    """(name, layer) of each LoRA layer, or why the adapter cannot be merged (another tuner, prompt learning)."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(config.is_prompt_learning for config in model.peft_config.values()):
        return [], "a prompt-learning adapter changes the inputs, not the weights"
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            layers.append((name, module))
        elif isinstance(module, BaseTunerLayer):
            kind = f"{type(module).__module__}.{type(module).__name__}"
            return [], f"{name} is a {kind}, and distrib merges LoRA layers only: {_MERGE_YOURSELF}"
    return layers, None


def _trained_name(name: str, adapters: list[str]) -> str | None:
    """The base model's name of an active adapter's modules_to_save copy (the trained one, which replaces the
    base's), else None."""
    for adapter in adapters:
        marker = f".modules_to_save.{adapter}."
        if marker in name:
            return name.removeprefix(_WRAPPED).replace(marker, ".")
    return None


def _linear_block(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                  fan_in_fan_out: bool) -> torch.Tensor:
    """This rank's block of peft's merged weight, weight + transpose(B @ A, fan_in_fan_out) * scaling, from the
    whole (small) A and B: only the block's rows of B and columns of A are multiplied, nothing the size of the
    whole weight is made."""
    local = local_part(weight).detach()
    rows, cols = block_slices(*local_block(weight))
    cast = local.device.type == "cpu" and lora_b.dtype in (torch.float16, torch.bfloat16)  # as peft: fp32 on a CPU
    a, b = (t.to(local.device, torch.float32 if cast else t.dtype) for t in (lora_a, lora_b))
    delta = (b[cols] @ a[:, rows]).T if fan_in_fan_out else b[rows] @ a[:, cols]
    return (local + (delta * scaling).to(lora_b.dtype)).to(local.dtype)


def _as_weight(block: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if isinstance(like, DTensor):
        return DTensor.from_local(block, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
    return block


def _base_names(model: nn.Module, name: str, layer: nn.Module) -> tuple[str, str | None]:
    """The base model's names of the weight and bias a LoRA layer adds its delta to: a layer's own, or for peft's
    ParamWrapper (LoRA on a parameter: transformers' fused experts) its parameter on the module it wraps."""
    parameter = getattr(layer, "parameter_name", None)
    if parameter is not None:  # nested wrappers (one per parameter) each add a base_layer, which base_name drops
        return base_name(model, f"{name}.base_layer.{parameter}"), None
    return base_name(model, f"{name}.base_layer.weight"), base_name(model, f"{name}.base_layer.bias")


def _experts_first(layer: nn.Module, weight: torch.Tensor) -> bool:
    """Whether the layer is peft's LoRA on an experts-first 3-D parameter (an A and a B per expert)."""
    return getattr(layer, "parameter_name", None) is not None and weight.dim() == 3 and layer.num_experts > 1


def _experts_block(weight: torch.Tensor, layer: nn.Module, adapter: str, lora_a: torch.Tensor,
                   lora_b: torch.Tensor) -> torch.Tensor:
    """This rank's block of peft's merged experts tensor (ParamWrapper.get_delta_weight added), from the whole
    (small) A and B: only the block's experts are multiplied."""
    local = local_part(weight).detach()
    experts, *rest = block_slices(*local_block(weight))
    delta = lora_delta(layer, adapter, lora_a.to(local.device), lora_b.to(local.device), experts)
    return (local + delta[(slice(None), *rest)].to(local.dtype)).to(local.dtype)


def _merge_layer(model: nn.Module, name: str, layer: nn.Module, adapters: list[str], merged: dict,
                 whole: dict[str, torch.Tensor]) -> str | None:
    """Adds each active adapter's delta of one LoRA layer into merged[its base weight (and bias)], as peft's merge
    does; returns why it cannot, else None."""
    from peft.tuners.lora import Linear

    weight, bias = _base_names(model, name, layer)
    if weight not in merged:
        return f"{name}'s base weight is tied to another tensor: {_MERGE_YOURSELF}"
    sharded = any(isinstance(tensor, DTensor) for tensor in merged.values())
    for adapter in adapters:
        if adapter not in layer.lora_A and adapter not in layer.lora_embedding_A or adapter in layer.merged_adapters:
            continue
        scaling, variant = layer.scaling[adapter], getattr(layer, "lora_variant", {}).get(adapter)
        if variant is None and getattr(layer, "use_dora", {}).get(adapter):  # an older peft's DoRA, merged inline
            return f"{name} is a DoRA layer of a peft without LoRA variants: {_MERGE_YOURSELF}"
        if isinstance(layer, Linear) and variant is None:
            lora_a, lora_b = (whole[f"{name}.lora_{ab}.{adapter}.weight"] for ab in "AB")
            merged[weight] = _as_weight(_linear_block(merged[weight], lora_a, lora_b, scaling, layer.fan_in_fan_out),
                                        merged[weight])
        elif _experts_first(layer, merged[weight]):
            lora_a, lora_b = (whole[f"{name}.lora_{ab}.{adapter}.weight"] for ab in "AB")
            merged[weight] = _as_weight(_experts_block(merged[weight], layer, adapter, lora_a, lora_b), merged[weight])
        elif not sharded:  # a whole tensor: peft's own delta (Embedding, Conv) or variant (DoRA) merge
            with torch.no_grad():
                base = merged[weight].detach()
                merged[weight] = (variant.merge_safe(layer, adapter, base.clone()) if variant is not None else
                                  (base + layer.get_delta_weight(adapter)).to(base.dtype))
        else:
            return (f"{name} is a {type(layer).__name__}{' with ' + type(variant).__name__ if variant else ''} "
                    f"layer, which distrib merges under ddp only: {_MERGE_YOURSELF}")
        if getattr(layer, "lora_bias", {}).get(adapter):
            lora_bias = whole[f"{name}.lora_B.{adapter}.bias"]
            local = local_part(merged[bias]).detach()
            (rows,) = block_slices(*local_block(merged[bias]))
            merged[bias] = _as_weight((local + lora_bias[rows].to(local) * scaling).to(local.dtype), merged[bias])
    return None


def merged_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], str | None]:
    """The merged model's tensors under the base model's names (each rank's blocks, DTensors where the model's are),
    from the wrapped model's (model_tensors) and the adapter's whole tensors; or ({}, why it cannot be merged)."""
    layers, why = _lora_layers(model)
    if why:
        return {}, why
    adapters = list(model.active_adapters)
    merged = {}
    for name, tensor in tensors.items():
        key = base_name(model, name) or _trained_name(name, adapters)
        if key is not None:  # a modules_to_save copy replaces its base module's tensor, in the base's place
            merged[key] = tensor
    for name, layer in layers:
        why = _merge_layer(model, name, layer, adapters, merged, whole)
        if why:
            return {}, why
    return merged, None


def trained_base(model: nn.Module) -> str | None:
    """The first tensor of the base model that was trained (not frozen) outside peft's modules_to_save: the adapter
    alone does not hold it."""
    return next((name for name, parameter in model.named_parameters()
                 if parameter.requires_grad and base_name(model, name) is not None), None)


# ---------------------------------------------------------------- an adapter run's weights/, every rank


def save_adapter_run(model: nn.Module, tensors: dict[str, torch.Tensor], folder: Path, rank: int, init_from: str,
                     merged: bool, log, max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Every rank: `folder` as an adapter run's weights/ (the adapter, and merged/ unless model.merged_weights =
    false, in files of at most max_file_bytes), built in a temporary folder that rank 0 moves into place whole, then
    checked by loading it back."""
    from distrib.models.adapters import base_model

    tmp = folder.with_name(f".{folder.name}.tmp")
    whole = adapter_state(model)  # every rank: the adapter's DTensors gathered, the base's never
    error = None
    base = base_path(init_from) or next((config.base_model_name_or_path for config in model.peft_config.values()
                                         if config.base_model_name_or_path), None)
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # a write that died
            write_adapter(model, whole, tmp, base)
        except OSError as e:
            error = write_fault(folder, e)
    agree_write(error)
    merged_state, why = merged_tensors(model, tensors, whole) if merged else ({}, "model.merged_weights = false")
    if merged_state:
        save_weights(merged_state, tmp / MERGED_DIR, rank, hf_config(base_model(model)), max_file_bytes)
    if rank == 0:
        try:
            replace_folder(tmp, folder)
        except OSError as e:
            error = write_fault(folder, e)
    agree_write(error)
    agree_checked(rank, lambda: check_adapter_run(folder, model, merged_state, base))
    log(_described(folder, base, why, trained_base(model)))


def check_adapter_run(folder: Path, model: nn.Module, merged_state: dict[str, torch.Tensor], base: str | None) -> None:
    """Rank 0: each adapter's files as peft loads them; merged/ as from_pretrained builds it; the base that
    adapter_config.json names, where it is a folder with config.json (transformers' from_pretrained(weights/))."""
    from distrib.models.adapters import base_model

    for adapter in model.peft_config:
        check_adapter_folder(folder if adapter == "default" else folder / adapter, model, adapter)
    if merged_state:
        check_folder(folder / MERGED_DIR, base_model(model), merged_state)
    base_folder = Path(base) if base else None
    if base_folder and (base_folder / "config.json").is_file():
        built = architecture(base_folder, base_model(model))
        if built is not None:
            check_pretrained_folder(base_folder, built)


def _described(folder: Path, base: str | None, why: str | None, trained: str | None) -> str:
    """The log line: what weights/ holds and how each part loads."""
    if base is None:
        loads = "adapter_config.json names no base: give PeftModel.from_pretrained the base the factory built"
    elif Path(base).exists() and not (Path(base) / "config.json").is_file():
        loads = f"base {base}, not a Hugging Face folder: load it yourself, then PeftModel.from_pretrained"
    else:
        loads = f"base {base}: transformers' from_pretrained('{folder}') loads both"
    merged = (f"; {MERGED_DIR}/: the merged model (from_pretrained)" if why is None else
              f"; no {MERGED_DIR}/ ({why})")
    warning = (f"; {trained} of the base was trained too and is not in the adapter: load {MERGED_DIR}/ or model.pt"
               if trained else "")
    return f"{folder}: the adapter in peft's format ({loads}){merged}{warning}"
