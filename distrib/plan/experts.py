"""What a model's experts add to `distrib plan`: each rank's expert bytes (of the layout the run builds), expert
parallel's all-to-all bytes per step, and the rows a rank's experts take when routing is at its worst; and the meta
passes through MoE layers, whose routing has no meta kernels (shape-only stand-ins, MetaRouting), nor autocast a
meta device (autocast_on_meta)."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import local_tensor
from distrib.torch_private import grouped_mm
from distrib.training.experts import split_experts, top_k_of


def _shapes_only(tensor) -> bool:
    from distrib.torch_private import is_fake

    return isinstance(tensor, torch.Tensor) and (tensor.is_meta or is_fake(tensor))


class MetaRouting(TorchFunctionMode):
    """The MoE layers' routing on meta and fake tensors (the plan's passes, the dry run's step): torch has no meta
    kernel for bincount (its length depends on the values: here minlength, every expert id below it), and its
    grouped_mm's refuses fp32 (it checks a GPU's dtypes). Each is replaced by one of its shape that saves for backward
    what it does (grouped_mm: its two operands). A branch on a boolean the pass has no value of is taken as true:
    transformers' "is the attention mask all ones?" (then it runs SDPA's causal path, as for unpadded samples)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.bincount and _shapes_only(args[0]) and kwargs.get("weights") is None:
            ids, size = args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return torch.zeros(size, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
        if func is grouped_mm and _shapes_only(args[0]) and args[0].dim() == 2 and args[1].dim() == 3:
            return args[0] @ args[1][0]  # [rows, in] x [in, out] of one expert: the output's shape, the same saves
        if func is torch.Tensor.__bool__ and _shapes_only(args[0]) and args[0].dtype == torch.bool:
            return True  # a branch on a value a shapes-only pass has none of: transformers' "is the mask all ones?"
        return func(*args, **kwargs)

    # Activation checkpointing's recomputation runs without torch function modes: F.grouped_mm itself is swapped for
    # the pass, so that a block's recomputation saves what its forward saved (its check compares them).
    def __enter__(self):
        self._grouped = F.grouped_mm
        F.grouped_mm = functools.partial(_grouped_shapes, self._grouped)
        return super().__enter__()

    def __exit__(self, *exc):
        F.grouped_mm = self._grouped
        return super().__exit__(*exc)


def _grouped_shapes(grouped, a: torch.Tensor, b: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """F.grouped_mm, but on shapes-only operands [rows, in] x [experts, in, out] one expert's product: its shape."""
    if _shapes_only(a) and a.dim() == 2 and b.dim() == 3:
        return a @ b[0]
    return grouped(a, b, *args, **kwargs)


class _MetaAsCPU(torch.autocast):
    """torch.autocast, which refuses device_type "meta" (no autocast dtype: "unsupported scalarType"), taking it as
    the CPU's: autocast acts on its own device's tensors only, so on meta tensors either does nothing."""

    def __init__(self, device_type: str, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


@contextlib.contextmanager
def autocast_on_meta() -> Iterator[None]:
    """The plan's meta passes through code that opens an autocast of its tensors' device: peft's LoRA on fused experts
    (its parametrization's fold, _LoraFactorsProxy, runs under torch.autocast(W.device.type, enabled=False)). A mode
    cannot catch it (autocast's constructor is no torch function): torch.autocast is swapped for the pass only."""
    real = torch.autocast, torch.amp.autocast
    torch.autocast = torch.amp.autocast = _MetaAsCPU
    try:
        yield
    finally:
        torch.autocast, torch.amp.autocast = real


def model_experts(model: nn.Module) -> dict[str, nn.Module]:
    """{name: experts module} of each MoE layer the model holds in a form expert parallel splits (the built-in GPT's,
    transformers' fused experts); {} for a model without, or with experts of another form (fsdp shards those like any
    parameter: in the state, not among the experts' figures)."""
    return {name: experts.module for name, experts in split_experts(model).items()}


def _widths(experts: nn.Module) -> tuple[int, int, int]:
    """(experts, width, hidden width) of an experts module: the GPT's w1 [E, hidden, dim], transformers' fused
    down_proj [E, dim, hidden] ([E, hidden, dim] transposed)."""
    if hasattr(experts, "w1"):
        return experts.w1.shape
    down = experts.down_proj.shape
    dim, hidden = (down[2], down[1]) if getattr(experts, "is_transposed", False) else (down[1], down[2])
    return down[0], hidden, dim


def expert_layers(model: nn.Module) -> list[dict]:
    """Each MoE layer's experts module the model holds (model_experts): its experts, width, hidden width, and the
    top_k and capacity factor of the layer around it."""
    modules = dict(model.named_modules())
    found = []
    for name, experts in model_experts(model).items():
        parent = modules.get(name.rpartition(".")[0], model)
        n_experts, hidden, dim = _widths(experts)
        found.append({"name": name, "n_experts": n_experts, "dim": dim, "hidden": hidden, "top_k": top_k_of(parent),
                      "capacity_factor": getattr(parent, "capacity_factor", 0)})
    return found


def held_experts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's part of the experts, from its laid-out model (its local shards, as the run holds them): the bytes of
    their parameters, and of their parameters, gradients and optimizer state; and their layers (expert_layers). Under
    peft's LoRA on the experts their adapters are among them (trained, split with them); frozen weights have neither
    gradients nor optimizer state."""
    # the outermost LoRA wrapper's parameters hold the inner wrappers' and the experts module's, each once
    params = [p for experts in split_experts(model).values()
              for p in (experts.adapters[0] if experts.adapters else experts.module).parameters()]
    parameters = sum(local_tensor(p).nbytes for p in params)
    gradients = sum(local_tensor(p).nbytes for p in params if p.requires_grad)
    optimizer_bytes = sum(local_tensor(value).nbytes for p in params for value in optimizer.state.get(p, {}).values()
                          if isinstance(value, torch.Tensor))
    return {"expert_parameter_bytes_per_rank": parameters,
            "expert_state_bytes_per_rank": parameters + gradients + optimizer_bytes, "layers": expert_layers(model)}


def all_to_all_split(dims: ParallelDims, per_node: int, nbytes: float) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends in an all-to-all of nbytes over its expert-parallel group, the
    rows spread evenly over the group's ranks: ep is the inner part of the shard dimension, its ranks batch_sharers
    apart (those that read the same micro-batch, innermost; ranks numbered node by node)."""
    size, stride = dims.expert_parallel, dims.batch_sharers
    local = max(1, min(size, per_node // stride)) if per_node % stride == 0 else 1
    return nbytes * (local - 1) / size, nbytes * (size - local) / size


def expert_plan(held: dict, dims: ParallelDims, per_node: int, tokens: int, compute_bytes: int, grad_accum: int,
                recomputed: bool) -> dict:
    """The experts' figures of plan_run: held's bytes; under expert parallel the all-to-all bytes each rank sends
    per step (every MoE layer, each micro-step: its rows to their experts and back in forward, their gradients in
    backward, the forward again where blocks are recomputed); and the rows a rank's experts take per layer and
    micro-batch, balanced and at worst (every routed token of its ep group to its experts, or as many as capacity
    keeps), with their activations at the worst (the row and SwiGLU's four intermediates; measured: tests). tokens:
    the micro-batch's, of which a rank routes its part (1 / dims.token_split)."""
    layers, tokens = held["layers"], tokens // dims.token_split
    figures = {"expert_parallel": dims.expert_parallel, "moe_layers_per_rank": len(layers),
               "expert_parameter_bytes_per_rank": held["expert_parameter_bytes_per_rank"],
               "expert_state_bytes_per_rank": held["expert_state_bytes_per_rank"]}
    passes = 4 + (2 if recomputed else 0)
    sent = sum(tokens * layer["top_k"] * layer["dim"] * compute_bytes for layer in layers) * passes * grad_accum
    intra, inter = all_to_all_split(dims, per_node, sent) if dims.expert_parallel > 1 else (0, 0)
    rows = max((tokens * layer["top_k"] for layer in layers), default=0)
    worst = [_worst_rows(layer, tokens, dims.expert_parallel) for layer in layers]
    widest = max(layers, key=lambda layer: layer["dim"] + 4 * layer["hidden"], default=None)
    per_row = (widest["dim"] + 4 * widest["hidden"]) * compute_bytes if widest else 0
    return {**figures, "all_to_all_bytes_per_step_intra_node": intra, "all_to_all_bytes_per_step_inter_node": inter,
            "expert_rows_per_micro_batch": rows, "expert_rows_per_micro_batch_worst": max(worst, default=0),
            "expert_activation_bytes_worst": max(worst, default=0) * per_row,
            "expert_capacity_factor": max((layer["capacity_factor"] for layer in layers), default=0)}


def _worst_rows(layer: dict, tokens: int, expert_parallel: int) -> int:
    """The most rows one rank's experts of this layer take in a micro-batch: every routed token of its ep group, or
    with a capacity factor each of its experts full from every rank of the group (MoE.dispatch's capacity, per
    rank and call)."""
    rows = tokens * layer["top_k"]
    if layer["capacity_factor"] > 0:
        capacity = math.ceil(layer["capacity_factor"] * rows / layer["n_experts"])
        return min(expert_parallel * rows, layer["n_experts"] * capacity)
    return expert_parallel * rows


def expert_rows(f: dict, size) -> list[tuple[str, str]]:
    """distrib plan's lines for a model with experts: each rank's expert bytes, expert parallel's all-to-all, and the
    worst-case imbalance."""
    if not f.get("moe_layers_per_rank"):
        return []
    ep = f["expert_parallel"]
    rows = [("experts / rank", f"{size(f['expert_state_bytes_per_rank'])} of parameters, gradients and optimizer "
                               f"state ({size(f['expert_parameter_bytes_per_rank'])} of parameters; "
                               f"{f['moe_layers_per_rank']} MoE layers" + (f", 1/{ep} of each one's experts"
                                                                          if ep > 1 else "") + ")")]
    if ep > 1:
        rows.append(("all-to-all / step", f"{size(f['all_to_all_bytes_per_step_intra_node'])} intra-node, "
                                          f"{size(f['all_to_all_bytes_per_step_inter_node'])} inter-node per rank "
                                          "(tokens to their experts and back; in the collectives' figures)"))
    worst, balanced = f["expert_rows_per_micro_batch_worst"], f["expert_rows_per_micro_batch"]
    limit = f"capacity_factor {f['expert_capacity_factor']:g}" if f["expert_capacity_factor"] else "dropless"
    rows.append(("expert imbalance", f"a rank's experts take {balanced:,} rows per layer and micro-batch when "
                                     f"balanced, at worst {worst:,} ({worst / max(balanced, 1):.1f}x, {limit}): "
                                     f"{size(f['expert_activation_bytes_worst'])} of activations in one layer"))
    return rows
