"""How a pretrained source's names map onto a model's: the prefixes a saved state_dict may carry or lack, the names a
Hugging Face model declares it may miss, a peft adapter's base model, the tensors of other pipeline stages; and the
one-line error when the weights do not fit the model."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.nn as nn

from distrib.errors import UserError
from distrib.models import adapters


@dataclass(frozen=True)
class Pretrained:
    """Weights checked against a model: which of the source's names goes into which of the model's."""

    source: object  # Safetensors | TorchFile | DcpCheckpoint
    names: dict[str, str]  # model name -> source name
    renamed: str = ""  # how the names were matched, when not as they are
    left_out: list[str] = field(default_factory=list)  # a head the model does not have (a base model from a full one)
    kept: list[str] = field(default_factory=list)  # an adapter's tensors, not in base weights: their own init


def rename(name: str, prefix: str, how: str) -> str | None:
    if how == "add":
        return prefix + name
    return name[len(prefix):] if name.startswith(prefix) else None


def renaming(expected: set[str], names, base: str) -> tuple[str, str]:
    """(prefix, strip | add), the empty prefix for names as they are: the Hugging Face conventions (a base
    model's weights inside a model with a head are under base_model_prefix), and DDP's or torch.compile's prefix on
    a state_dict saved from the wrapper; the one that matches the most names, as they are on a tie."""
    options = [("", "strip"), ("module.", "strip"), ("_orig_mod.", "strip")]
    options += [(base + ".", "strip"), (base + ".", "add")] if base else []
    return max(options, key=lambda option: sum(rename(n, *option) in expected for n in names))


def ignored(model: nn.Module, kind: str, name: str) -> bool:
    """Names a Hugging Face model declares it may miss or not know (_keys_to_ignore_on_load_missing, ...)."""
    patterns = getattr(model, f"_keys_to_ignore_on_load_{kind}", None) or ()
    return any(re.search(pattern, name) for pattern in patterns)


def misfit(path, missing: list[str], unexpected: list[str], misshaped: list[tuple]) -> UserError:
    parts = [f"{len(missing)} missing (first {missing[0]})" if missing else "",
             f"{len(unexpected)} unexpected (first {unexpected[0]})" if unexpected else "",
             (f"{len(misshaped)} mis-shaped (first {misshaped[0][0]}: {list(misshaped[0][1])} in the weights, "
              f"{list(misshaped[0][2])} in the model)") if misshaped else ""]
    return UserError(f"model.init_from = {str(path)!r}: the weights do not fit the model, "
                     f"{'; '.join(p for p in parts if p)}; give the weights of this model (the same architecture and "
                     "sizes), or build the model they were saved from (model.name, model.factory, model.kwargs)")


def base_view(model: nn.Module) -> tuple[nn.Module, dict[str, str], list[str]]:
    """(the model whose names weights are saved under, {its name: the model's name}, the model's adapter tensors):
    the model itself, or for a peft adapter the base model inside it, whose weights fill the wrapped layers."""
    names = list(model.state_dict())
    if not adapters.is_peft(model):
        return model, {name: name for name in names}, []
    view = {adapters.base_name(model, name): name for name in names}
    return adapters.base_model(model), {base: name for base, name in view.items() if base is not None}, \
        [name for name in names if adapters.base_name(model, name) is None]


def other_stages(model: nn.Module, state: dict) -> dict[str, tuple]:
    """Under pipeline parallel (one rank's stages, a Pipelined view: distrib.distributed.pipeline) the names and
    shapes of the whole model's tensors this rank does not hold: the rest of a weights file, which the other stages'
    ranks read. Every rank checks them all, so that all reach the same verdict before the collective load."""
    whole = getattr(getattr(model, "pipeline", None), "whole", None)
    if whole is None:
        return {}
    return {name: tuple(tensor.shape) for name, tensor in whole.state_dict().items() if name not in state}

