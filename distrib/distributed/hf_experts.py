"""A transformers mixture of experts' routed experts as expert parallel needs them: one module per MoE layer holding
every expert in fused, experts-first tensors (transformers' use_experts_implementation classes), or why not
(distrib.distributed.expert_modules.find_experts refuses in one line).

Expert parallel places a share of dim 0 (the experts) of those tensors on each rank; a family that keeps its experts
as a list of per-expert modules, or in tensors whose dim 0 is not the experts (DBRX's [E * ffn, dim]), has no such
dim to place, and trains with its experts sharded by fsdp like any parameter."""

from __future__ import annotations

import torch
import torch.nn as nn

# The fused tensors of transformers' experts classes (use_experts_implementation): gate and up projections joined
# (up alone where there is no gate), and the down projection; each [experts, ...] (transposed or not).
FUSED = ("gate_up_proj", "down_proj")
UNGATED = ("up_proj", "down_proj")


def _tensors(module: nn.Module) -> tuple[str, ...]:
    return UNGATED if getattr(module, "has_gate", True) is False else FUSED


def not_fused_experts_first(module: nn.Module) -> str | None:
    """None when the module (one named `experts`) is transformers' fused experts with every expert tensor
    experts-first, else why not, in words that follow its name."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return f"holds its {len(module)} experts as per-expert modules, not fused tensors"
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int):
        return "does not say its number of experts (num_experts)"
    fused = hasattr(module, "is_transposed")  # set by use_experts_implementation
    params = dict(module.named_parameters())
    for name in _tensors(module) if fused else params:
        tensor = params.get(name)
        if tensor is None or tensor.dim() != 3 or tensor.shape[0] != count:
            shape = list(tensor.shape) if tensor is not None else "absent"
            return f"holds {name} {shape}, not experts-first ([{count}, ...])"
    if not fused:
        return "is not transformers' fused experts (use_experts_implementation)"
    # every tensor is split by expert (biases too): one shared by all experts (a post-expert norm) would be one
    # rank's tokens' gradient on each rank
    shared = next(((name, p) for name, p in params.items() if p.dim() == 0 or p.shape[0] != count), None)
    return f"holds {shared[0]} {list(shared[1].shape)}, not split by expert" if shared else None


def lora_delta(layer: nn.Module, adapter: str, lora_a: torch.Tensor, lora_b: torch.Tensor,
               experts: slice) -> torch.Tensor:
    """What peft's LoRA on a fused experts tensor (its ParamWrapper: A [experts x rank, in], B [out, rank x experts])
    adds to `experts` of it, scaled, in the tensor's own layout: ParamWrapper.get_delta_weight's rows of those experts,
    made from theirs of A and B alone (what a rank holding those experts needs, under expert parallel or fsdp)."""
    count = layer.num_experts
    a = lora_a.reshape(count, -1, lora_a.shape[-1])[experts]  # experts, rank, in
    b = lora_b.reshape(lora_b.shape[0], -1, count)[..., experts]  # out, rank, experts
    # the tensor is [experts, out, in] where peft swapped its features (transformers' is_transposed False)
    pattern = "o r e, e r i -> e o i" if layer._did_swap_in_out_features else "o r e, e r i -> e i o"
    return torch.einsum(pattern, b, a) * layer.scaling[adapter]


def lora_on_experts(layer: nn.Module, module: nn.Module) -> str | None:
    """None when `layer` (a peft tuner layer around the experts module) is LoRA on one of the module's fused tensors
    with an A and a B per expert (peft's ParamWrapper), which expert parallel splits with their experts; else why not,
    in words that follow the module's name."""
    parameter = getattr(layer, "parameter_name", None)
    if parameter is None or not hasattr(layer, "lora_A") or not hasattr(layer, "_did_swap_in_out_features"):
        return (f"carries a {type(layer).__name__} adapter, and expert parallel splits only peft's LoRA on fused "
                "experts (ParamWrapper) with their experts")
    if getattr(layer, "num_experts", None) != getattr(module, "num_experts", None):
        return f"carries LoRA on {parameter} for {getattr(layer, 'num_experts', None)} experts, not its own number"
    return None
