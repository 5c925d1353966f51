"""A Hugging Face decoder's pipeline stage (a model that declares transformers' pipeline plan, `_pp_plan`): the units
it holds in the plan's order, taking token ids (the first stage) or the hidden states the stage before sent.

The model's own forward cannot run a stage (it calls its base model whole, which calls every unit, and returns an
output object). A stage runs its embeddings, then its decoder layers as the base model's forward calls them: the
rotary `position_embeddings` computed in the stage from `position_ids` (the sequence's positions: the rotary module is
no unit, every stage keeps it) and the mask transformers' own masking makes for no padding (None under SDPA, whose
causal attention then runs), then the final norm and the head: the logits, a tensor, on the last stage. Inside a
pipeline's step of packed documents or context parallel (distrib.distributed.step_inputs) the positions are the
step's, the mask transformers makes of packed positions, or context parallel's attention over the group's keys
(`attend`, handed down to its attention function: context_parallel.hf_attention) in place of any mask."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from distrib.distributed.pipeline.split import declared_units
from distrib.distributed.step_inputs import ATTEND, step_inputs
from distrib.errors import UserError

_MASKS = {"full_attention": "create_causal_mask", "sliding_attention": "create_sliding_window_causal_mask"}


def stage_class(model: nn.Module) -> type | None:
    """The class of a Hugging Face decoder's stage views: the model's own class with stage_forward as its forward,
    the plan's units in the forward's order (declared_units) on it; None for any other model, whose forward runs a
    stage (the built-in GPT's skips the units it lacks; an nn.Sequential runs its children)."""
    if getattr(model, "_pipeline_units", None) or not getattr(model, "_pp_plan", None):
        return None
    return _stage_class(type(model), tuple(pattern.removesuffix(".*") for pattern in declared_units(model)))


@functools.cache  # one class per model class: the stages of every run of it are of one type
def _stage_class(base: type, units: tuple[str, ...]) -> type:
    return type(f"{base.__name__}Stage", (base,), {"__module__": base.__module__, "forward": stage_forward,
                                                   "_stage_units": units})


def stage_forward(self, x: torch.Tensor) -> torch.Tensor:
    """This stage's units in turn (a unit of another stage is None in its parent, or absent from the layer list)."""
    for name in self._stage_units:
        parent_name, _, child = name.rpartition(".")
        parent = self.get_submodule(parent_name) if parent_name else self
        module = parent._modules.get(child)
        if isinstance(module, nn.ModuleList):
            x = _layers(parent, module, x)
        elif module is not None:
            x = module(x)
    return x


def _layers(base: nn.Module, layers: nn.ModuleList, hidden: torch.Tensor) -> torch.Tensor:
    """The decoder layers this stage holds, called as the base model's forward calls them (no cache)."""
    if not layers._modules:
        return hidden
    step = step_inputs()
    packed = step is not None and step.attend is None  # the positions restart at each document: a block mask
    position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0) if step is None \
        else step.position_ids
    rotary = getattr(base, "rotary_emb", None)
    extra = {"position_embeddings": rotary(hidden, position_ids)} if rotary is not None else {}
    if step is not None and step.attend is not None:
        extra[ATTEND] = step.attend
    config = base.config
    kinds = getattr(config, "layer_types", None)
    masks: dict[str, torch.Tensor | None] = {}
    for index, layer in layers._modules.items():
        kind = kinds[int(index)] if kinds else "full_attention"
        if kind not in masks:
            masks[kind] = _mask(config, kind, hidden, position_ids if packed else None) if ATTEND not in extra \
                else None
        out = layer(hidden, attention_mask=masks[kind], position_ids=position_ids, **extra)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def _mask(config, kind: str, hidden: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor | None:
    """transformers' own mask of a causal sequence without padding (pipeline inputs are one tensor of token ids), or
    of packed documents' positions (`packed`, as the whole model's forward makes it of them)."""
    from transformers import masking_utils

    if kind not in _MASKS:
        raise UserError(f"dist.pipeline_parallel > 1: {type(config).__name__}'s layer type {kind!r} has no mask that "
                        f"a pipeline stage knows ({', '.join(_MASKS)}); use --set dist.pipeline_parallel=1")
    make = getattr(masking_utils, _MASKS[kind])
    # position_ids None where they are 0..T-1: transformers then reads no packed sequences out of them (a check that
    # cannot run on the meta or fake tensors of distrib plan's dry run).
    return make(config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=packed)
