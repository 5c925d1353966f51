"""A transformers mixture of experts' routed experts as expert parallel needs them: one module per MoE layer holding
every expert in fused, experts-first tensors (transformers' use_experts_implementation classes), or a one-line refusal.

Expert parallel places a share of dim 0 (the experts) of those tensors on each rank; a family that keeps its experts
as a list of per-expert modules, or in tensors whose dim 0 is not the experts (DBRX's [E * ffn, dim]), has no such
dim to place, and trains with its experts sharded by fsdp like any parameter."""

from __future__ import annotations

import torch.nn as nn

from distrib.errors import ConfigError

# The fused tensors of transformers' experts classes (use_experts_implementation): gate and up projections joined
# (up alone where there is no gate), and the down projection; each [experts, ...] (transposed or not).
FUSED = ("gate_up_proj", "down_proj")
UNGATED = ("up_proj", "down_proj")


def _key(expert_parallel: int | None) -> str:
    return f"dist.expert_parallel = {expert_parallel}" if expert_parallel else "dist.expert_parallel > 1"


def _refuse(model: nn.Module, expert_parallel: int | None, why: str) -> ConfigError:
    return ConfigError(f"{_key(expert_parallel)}: {type(model).__name__} {why}; expert parallel places a share of "
                       "each MoE layer's fused experts-first tensors on each rank: set dist.expert_parallel = 1 (fsdp "
                       "shards its experts like any parameter)")


def _tensors(module: nn.Module) -> tuple[str, ...]:
    return UNGATED if getattr(module, "has_gate", True) is False else FUSED


def _fused_experts_first(module: nn.Module) -> str | None:
    """None when the module is transformers' fused experts with every expert tensor experts-first, else why not."""
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


def hf_experts(model: nn.Module, expert_parallel: int | None = None) -> dict[str, nn.Module]:
    """{module path: experts module} of every MoE layer of a transformers model (modules named `experts`), each
    holding fused experts-first tensors; a ConfigError naming the first that does not (per-expert modules, tensors not
    experts-first, no experts at all, or a number of experts the degree does not divide)."""
    found = {name: module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"}
    if not found:
        raise _refuse(model, expert_parallel, "has no experts module (a module named `experts`, as transformers' "
                                              "mixtures of experts have)")
    for name, module in found.items():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise _refuse(model, expert_parallel, f"holds its experts as per-expert modules ({name}: a "
                                                  f"{type(module).__name__} of {len(module)}), not fused tensors")
        why = _fused_experts_first(module)
        if why:
            raise _refuse(model, expert_parallel, f"{name} ({type(module).__name__}) {why}")
        if expert_parallel and module.num_experts % expert_parallel:
            raise ConfigError(f"{_key(expert_parallel)}: {type(model).__name__}'s {name} holds {module.num_experts} "
                              "experts, which the degree does not divide; set dist.expert_parallel to a divisor of "
                              f"{module.num_experts}")
    return found
