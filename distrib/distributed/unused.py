"""Parameters that get no gradient in some steps: a model's conditional modules (its experts lists) and the probe of the
first batch that finds a trainable parameter its outputs do not reach; what ddp's find_unused_parameters reads.

Such a parameter fires no DDP hook and writes no .grad; under FSDP2 a unit whose forward never runs on a rank fires no
post-backward there, so no expert is a unit of its own (distrib.distributed.fsdp)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

# The model on the first batch's inputs (the worker's, from the data; None: no probe).
DryForward = Callable[[nn.Module], object]
_LISTS = (nn.ModuleList, nn.ModuleDict)


def experts_lists(model: nn.Module) -> list[str]:
    """The names of the model's experts lists: a ModuleList or ModuleDict whose name ends in "experts", as user MoEs
    and transformers' name them. Each member runs only on the tokens routed to it, none in some steps."""
    return [name for name, module in model.named_modules()
            if isinstance(module, _LISTS) and name.rsplit(".", 1)[-1].lower().endswith("experts")]


def inside_experts(model: nn.Module) -> set[int]:
    """The ids of every module inside an experts list (its members and what they hold)."""
    lists = set(experts_lists(model))
    return {id(inner) for name, module in model.named_modules() if name in lists
            for member in module.children() for inner in member.modules()}


def _tensors(outputs) -> list[torch.Tensor]:
    """Every tensor in a model's outputs: a tensor, a dict (a ModelOutput is one), a list or tuple, an object's
    attributes."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    elif not isinstance(outputs, (list, tuple)):
        outputs = list(vars(outputs).values()) if hasattr(outputs, "__dict__") else []
    return [tensor for item in outputs for tensor in _tensors(item)]


def unreached(model: nn.Module, dry_forward: DryForward | None) -> list[str]:
    """The trainable parameters that the sum of the floating outputs on the first batch does not reach (in eval mode,
    as the dry batch runs: no dropout draw, no BatchNorm statistics). Empty when the probe cannot run: a forward that
    raises is the dry batch's to report, in one line."""
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if dry_forward is None or not trainable:
        return []
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            outputs = [t for t in _tensors(dry_forward(model)) if t.is_floating_point() and t.requires_grad]
            if not outputs:
                return []
            grads = torch.autograd.grad(sum(t.float().sum() for t in outputs), [p for _, p in trainable],
                                        allow_unused=True)
    except Exception:  # noqa: BLE001 - the user's model or data: the dry batch after this says what is wrong
        return []
    finally:
        model.train(was_training)
    return [name for (name, _), grad in zip(trainable, grads) if grad is None]


def find_unused(setting: bool | str, model: nn.Module, dry_forward: DryForward | None, device: torch.device,
                log: Callable[[str], None]) -> bool:
    """dist.find_unused_parameters resolved: true, false, or auto: on when the model has experts lists or the first
    batch leaves a trainable parameter unreached on any rank. A collective under auto (every rank decides alike)."""
    if setting != "auto":
        return bool(setting)
    lists = experts_lists(model)
    missed = [] if lists else unreached(model, dry_forward)
    found = torch.tensor([float(bool(lists or missed))], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX)  # one rank's batch may miss what another's reaches
    if not found.item():
        return False
    log(f"dist.find_unused_parameters = auto: on, since {_reason(lists, missed)}; DDP then finds the parameters "
        "that get no gradient in each step (one pass over its graph); where every parameter gets one in every step, "
        "--set dist.find_unused_parameters=false saves that")
    return True


def _reason(lists: list[str], missed: list[str]) -> str:
    if lists:
        shown = ", ".join(lists[:3]) + (", ..." if len(lists) > 3 else "")
        return f"the model has experts ({shown}), whose members run only on the tokens routed to them"
    if missed:
        more = f" and {len(missed) - 1} more" if len(missed) > 1 else ""
        return f"the first batch left the parameter {missed[0]}{more} without a gradient"
    return "another rank's first batch left a parameter without a gradient"
