"""Which modules of a model are its routed experts, of which form, and how many experts each holds: the one answer
that the launcher's check before any worker starts and each worker's expert parallel both read (find_experts).

Two forms are split by expert parallel: the contract's (distrib.models.moe.GroupedExperts: w1, w2, w3, experts first)
and transformers' fused experts (hf_experts: gate_up_proj and down_proj, experts first). Anything else named `experts`
(per-expert modules, tensors whose dim 0 is not the experts, another adapter than peft's LoRA on fused experts) is
refused in one line that says why and what to do."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from distrib.distributed.hf_experts import lora_on_experts, not_fused_experts_first
from distrib.errors import ConfigError

# The contract's expert weights (distrib.models.moe.GroupedExperts): 3-D, the experts first.
WEIGHTS = ("w1", "w2", "w3")


@dataclass(frozen=True)
class Experts:
    """One MoE layer's experts module: its number of experts, whether it is transformers' fused form (else the
    contract's w1, w2, w3), and peft's LoRA wrappers around it (ParamWrapper, one per adapted tensor, outermost
    first; the module named `experts` is then the outermost)."""

    module: nn.Module
    num_experts: int
    fused: bool
    adapters: tuple[nn.Module, ...] = ()


def is_grouped_experts(module: nn.Module) -> bool:
    """Whether a module holds experts in the contract's form: parameters w1, w2, w3, each 3-D with the same number
    of experts first."""
    own = dict(module.named_parameters(recurse=False))
    return all(name in own and own[name].dim() == 3 for name in WEIGHTS) and \
        len({own[name].shape[0] for name in WEIGHTS}) == 1


def find_experts(model: nn.Module, expert_parallel: int) -> dict[str, Experts]:
    """{module path: Experts} of every module named `experts` (each MoE layer's), in either form expert parallel
    splits; a one-line ConfigError naming dist.expert_parallel, the first module it cannot split and the fix: no
    experts at all, another form, a LoRA adapter on them, or a number of experts the degree does not divide."""
    named = {name: module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"}
    key = f"dist.expert_parallel = {expert_parallel}"
    if not named:
        raise ConfigError(f"{key}: the model ({type(model).__name__}) has no experts to split (a module named "
                          "`experts` holding them experts-first: the built-in GPT's MoE layers, model.kwargs "
                          "n_experts, or a transformers mixture of experts' fused experts); use --set "
                          "dist.expert_parallel=1")
    found = {name: _experts(model, name, module, key) for name, module in named.items()}
    for name, experts in found.items():
        count = experts.num_experts
        if count % expert_parallel:
            working = [d for d in range(1, count + 1) if count % d == 0]
            raise ConfigError(f"{key}: {name} holds {count} experts, which {expert_parallel} ranks cannot split "
                              f"evenly; use a divisor of {count} ({', '.join(map(str, working))})")
    return found


def _experts(model: nn.Module, name: str, module: nn.Module, key: str) -> Experts:
    adapters = []
    while callable(getattr(module, "get_base_layer", None)):  # peft's tuner layers in place of the experts module
        adapters.append(module)
        module = module.base_layer
    if is_grouped_experts(module):
        if not adapters:
            return Experts(module, module.w1.shape[0], fused=False)
        why = "carries a LoRA adapter, which expert parallel splits with the experts of transformers' fused ones only"
    else:
        why = not_fused_experts_first(module) or next(
            filter(None, (lora_on_experts(adapter, module) for adapter in adapters)), None)
    if why:
        raise ConfigError(f"{key}: {type(model).__name__}'s {name} ({type(module).__name__}) {why}; expert parallel "
                          "places a share of each MoE layer's experts-first tensors on each rank: set "
                          "dist.expert_parallel = 1 (fsdp shards its experts like any parameter)")
    return Experts(module, module.num_experts, fused=True, adapters=tuple(adapters))
