"""Tensor parallel (dist.tensor_parallel): torch's parallelize_module on the mesh's innermost dimension, with the
plan the model declares as `_tp_plan` (module names, `*` for any index -> "colwise" | "rowwise"; the convention of
Hugging Face's `base_model_tp_plan`). The built-in GPT's: q/k/v and the MLP's input projections column-wise, the
attention and MLP output projections row-wise, so each block does one all-reduce in forward and one in backward per
sub-layer; norms, embedding and output stay whole on every rank of the group (FSDP shards them over the others)."""

from __future__ import annotations

from fnmatch import fnmatch

import torch.nn as nn

from distrib.errors import ConfigError


def tensor_parallel_plan(model: nn.Module, size: int) -> dict[str, str]:
    """The model's declared plan, checked: every entry names Linear layers whose split dimension divides by size."""
    plan = getattr(model, "_tp_plan", None)
    name = type(model).__name__
    if not plan:
        raise ConfigError(f"dist.tensor_parallel = {size}: the model ({name}) declares no tensor-parallel plan "
                          "(a _tp_plan of module names -> colwise/rowwise, as the built-in GPT's); use --set "
                          "dist.tensor_parallel=1, or model.name = gpt")
    for pattern, style in plan.items():
        matched = [(n, m) for n, m in model.named_modules() if fnmatch(n, pattern)]
        if style not in ("colwise", "rowwise") or not matched:
            raise ConfigError(f"dist.tensor_parallel = {size}: {name}._tp_plan entry {pattern!r}: {style!r} "
                              "must be colwise or rowwise and name at least one module")
        for module_name, module in matched:
            width = module.out_features if style == "colwise" else module.in_features
            if not isinstance(module, nn.Linear) or width % size:
                raise ConfigError(f"dist.tensor_parallel = {size}: {module_name} ({type(module).__name__}, "
                                  f"{width} wide) cannot be split {size} ways; use a divisor of {width} (and of "
                                  "the attention heads)")
    return plan


def layers_split(model: nn.Module, style: str) -> list[nn.Module]:
    """The modules the model's _tp_plan splits in this style ("colwise" or "rowwise"); what distrib plan counts."""
    plan = getattr(model, "_tp_plan", None) or {}
    return [module for name, module in model.named_modules()
            if any(fnmatch(name, pattern) for pattern, each in plan.items() if each == style)]


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Splits the planned layers over tp_mesh in place (on the meta device, as the strategy builds it: each rank's
    slices are materialised afterwards); their outputs are plain tensors again."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = tensor_parallel_plan(model, tp_mesh.size())
    return parallelize_module(model, tp_mesh, {pattern: styles[style]() for pattern, style in plan.items()})
