"""Tensor parallel (dist.tensor_parallel): torch's parallelize_module on the mesh's innermost dimension, with the
plan the model declares as `_tp_plan` (module names, `*` for any index -> a style; transformers' own plans as they are).
The built-in GPT's: q/k/v and the MLP's input projections column-wise, the attention and MLP output projections
row-wise, so each block does one all-reduce in forward and one in backward per sub-layer; norms, embedding and output
stay whole on every rank of the group (FSDP shards them over the others)."""

from __future__ import annotations

import inspect
import math
from fnmatch import fnmatchcase

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from distrib.distributed.mesh import divisors, either
from distrib.errors import ConfigError
from distrib.torch_private import REDISTRIBUTE_LOGGER

# transformers' styles (transformers/distributed/tensor_parallel.py, ALL_PARALLEL_STYLES) distrib applies with torch's
# own, each as transformers lays it out: "colwise" ColwiseParallel(Replicate -> Shard(-1)), a local output (q/k/v and
# the MLP's input projections compute their own heads and hidden units); "rowwise" RowwiseParallel(Shard(-1) ->
# Replicate): its input is the colwise layer's local slice, one all-reduce after it; "colwise_gather_output" a
# colwise lm_head whose logits are gathered whole; "embedding_rowwise" the vocabulary split, ids replicated, the
# partial lookups summed; "sequence_parallel" SequenceParallel(use_local_output=True); and
# "replicated_with_grad_allreduce" (_SummedGradients).
STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "replicated_with_grad_allreduce",
          "sequence_parallel")
_LAYER = {"colwise": nn.Linear, "rowwise": nn.Linear, "colwise_gather_output": nn.Linear,
          "embedding_rowwise": nn.Embedding}  # the layer each splitting style splits; the other two keep it whole


def attention_heads(model: nn.Module) -> dict[str, int]:
    """{the key that sets it: count} of the attention heads and key-value heads the model declares: the built-in
    GPT's model.kwargs n_heads, a Hugging Face config's num_attention_heads and num_key_value_heads ({}: none)."""
    config = getattr(model, "config", None)  # a peft model's is its base model's
    heads = {f"config.{key}": getattr(config, key) for key in ("num_attention_heads", "num_key_value_heads")
             if isinstance(getattr(config, key, None), int)}
    if not heads and isinstance(getattr(model, "n_heads", None), int):
        heads["model.kwargs n_heads"] = model.n_heads
    return heads


def check_heads(name: str, heads: dict[str, int], size: int, ranks: int | None = None) -> None:
    """A one-line ConfigError when dist.tensor_parallel = size does not divide every count of heads (each rank
    computes whole heads), naming the count, the degrees that would work (the divisors of every count, and of
    `ranks`, the world's ranks per pipeline stage, where known) and the heads that would."""
    for key, count in heads.items():
        if count % size:
            working = [d for d in divisors(math.gcd(*heads.values())) if ranks is None or ranks % d == 0]
            word = "key-value heads" if "key_value" in key else "attention heads"
            keys = " and ".join(heads) + (" to multiples" if len(heads) > 1 else " to a multiple")
            raise ConfigError(f"dist.tensor_parallel = {size}: {name}'s {count} {word} ({key}) cannot be split "
                              f"{size} ways (each rank computes whole heads); use dist.tensor_parallel = "
                              f"{either(working)} (e.g. --set dist.tensor_parallel={working[-1]}), or set {keys} "
                              f"of {size}")


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The model's plan: each module that declares a `_tp_plan` (its entries relative to itself) covers what it
    holds, under its own name; the outermost wins, as transformers' own model holds its base model's plan under
    `model.` (a LlamaForCausalLM's `lm_head` with its `model.layers.*...`), so a peft wrapper or a user's module
    around a model finds it where the model sits, and an entry the factory dropped at the top stays dropped."""
    plan: dict[str, str] = {}
    covers: list[str] = []
    for name, module in model.named_modules():
        own = inspect.getattr_static(module, "_tp_plan", None)  # static: a peft wrapper's __getattr__ forwards
        if isinstance(own, dict) and own and not any(_under(name, root) for root in covers):
            covers.append(name)
            plan.update({f"{name}.{key}" if name else key: style for key, style in own.items()})
    return plan


def _under(name: str, root: str) -> bool:
    return not root or name == root or name.startswith(root + ".")


def matches(name: str, pattern: str) -> bool:
    """Whether a module name matches a plan entry, name by name between the dots (`*`: any one index), as
    torch's parallelize_module and transformers resolve them."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatchcase(part, each) for part, each in zip(parts, wanted))


def planned_modules(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{module name: style} of the modules the plan's entries name; two entries giving one module two styles are
    refused in one line."""
    planned: dict[str, str] = {}
    names = [name for name, _ in model.named_modules()]
    for pattern, style in plan.items():
        for name in (name for name in names if matches(name, pattern)):
            if planned.setdefault(name, style) != style:
                raise ConfigError(f"dist.tensor_parallel: {type(model).__name__}._tp_plan gives {name} two styles, "
                                  f"{planned[name]!r} and {style!r} (entry {pattern!r}); keep one entry for it")
    return planned


def tensor_parallel_plan(model: nn.Module, size: int, ranks: int | None = None, stage: bool = False) -> dict[str, str]:
    """The model's declared plan (declared_plan), checked: every entry a style distrib applies (STYLES), naming
    modules of its kind whose split dimension divides by size; and its attention heads (attention_heads) divisible by
    size (ranks: as check_heads). On one pipeline rank's stages (`stage`), entries naming other stages' modules only
    are not refused (the launcher checks the plan on the whole model)."""
    plan = declared_plan(model)
    name = type(model).__name__
    if not plan:
        raise ConfigError(f"dist.tensor_parallel = {size}: the model ({name}) declares no tensor-parallel plan "
                          "(a _tp_plan of module names -> styles, as transformers' Llama and Qwen2 and the built-in "
                          "GPT declare); use --set dist.tensor_parallel=1 (fsdp or hsdp alone), or model.name = gpt")
    check_heads(name, attention_heads(model), size, ranks)  # first: the degree is the fix to make before any other
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"dist.tensor_parallel = {size}: {name}._tp_plan entry {pattern!r}: {style!r} is not "
                              f"a style distrib applies ({', '.join(STYLES)}; packed and expert styles are not); use "
                              "--set dist.tensor_parallel=1")
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        _check_entry(modules, name, pattern, style, size, stage)
    planned_modules(model, plan)
    return plan


def _check_entry(modules: dict[str, nn.Module], name: str, pattern: str, style: str, size: int,
                 stage_view: bool) -> None:
    matched = [(each, module) for each, module in modules.items() if matches(each, pattern)]
    if not matched and not stage_view:
        raise ConfigError(f"dist.tensor_parallel = {size}: {name}._tp_plan entry {pattern!r}: names no module of the "
                          "model; name its modules as named_modules() gives them (`*` for any index)")
    layer = _LAYER.get(style)
    for module_name, module in matched if layer else ():
        if not isinstance(module, layer):
            raise ConfigError(f"dist.tensor_parallel = {size}: {name}._tp_plan entry {pattern!r}: {module_name} is a "
                              f"{type(module).__name__}; {style} splits nn.{layer.__name__} layers only; use --set "
                              "dist.tensor_parallel=1")
        width = module.num_embeddings if layer is nn.Embedding else \
            module.in_features if style == "rowwise" else module.out_features
        if width % size:
            raise ConfigError(f"dist.tensor_parallel = {size}: {module_name} ({width} wide) cannot be split {size} "
                              f"ways; use a divisor of {width} (and of the attention heads)")


def layers_split(model: nn.Module, style: str) -> list[nn.Module]:
    """The modules the model's plan splits in this style (e.g. "rowwise"); what distrib plan counts."""
    return [model.get_submodule(name) for name, each in planned_modules(model, declared_plan(model)).items()
            if each == style]


def torch_style(style: str):
    """torch's ParallelStyle for one of STYLES (a fresh one: parallelize_module sets its src_data_rank)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
            "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
            "replicated_with_grad_allreduce": _ReplicatedWithGradAllReduce}[style]()


def apply_tensor_parallel(model: nn.Module, tp_mesh, stage: bool = False) -> nn.Module:
    """Splits the planned modules over tp_mesh in place (on the meta device, as the strategy builds it: each rank's
    slices are materialised afterwards), one style per module by its own name (torch's `*` resolution warns for
    every subtree a pattern does not reach); their outputs are plain tensors again, each its own (_own_output). A
    weight two planned modules share (an lm_head tied to the embedding) is split once and shared again."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tensor_parallel_plan(model, tp_mesh.size(), stage=stage)
    planned = planned_modules(model, plan)
    ties = _ties(model, planned, tp_mesh.size())
    quiet_redistribute_warning()
    for name, style in planned.items():
        parallelize_module(model.get_submodule(name), tp_mesh, torch_style(style))
        model.get_submodule(name).register_forward_hook(_own_output)  # after torch's hook that makes it local
        if style == "embedding_rowwise":
            _split_gradient(model.get_submodule(name))
    for (first, key), *others in ties:
        for module, other in others:
            module._parameters[other] = first._parameters[key]
    return model


class _Own(torch.autograd.Function):
    """The identity, whose output is a tensor of its own (sharing the input's memory), not a view of it."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _own_output(module: nn.Module, args, output):
    """torch's styles hand a planned module's output back as a view of its DTensor's local tensor (to_local's
    view_as). Where that module is, or ends, an FSDP2 unit (an embedding or a head of its own, a pipeline stage whose
    last unit is the head), FSDP2 hooks its pre-backward on the view, which an in-place op on it would drop (FSDP2
    warns "returned a view tensor ... wrong gradients" each run): a tensor of its own keeps the hook, at no copy."""
    return _Own.apply(output) if isinstance(output, torch.Tensor) else output


class _AsParameter(torch.autograd.Function):
    """The identity forward; backward, the gradient laid out as the parameter (a DTensor's placements)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor) -> torch.Tensor:
        ctx.placements = param.placements
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.redistribute(placements=ctx.placements) if grad.placements != ctx.placements else grad


def _split_gradient(module: nn.Module) -> None:
    """DTensor has no row-wise rule for an embedding's backward: a vocabulary-split embedding's weight gradient comes
    out whole (Replicate) on every tp rank, and autograd and FSDP2 keep it so until the gradients are reduced, the
    microbatches' sum in float32 (tp x a rank's slice; a 70B Llama's 1.05B-parameter embedding: 2 + 4 bytes a
    parameter whole, more on each later microbatch). Laid out as the weight at once, only its whole compute-dtype
    gradient lives, in the embedding's backward; the slice is the same values, so the weights stay bitwise the same."""
    kept: list[dict] = []

    def split(module, args):
        kept.append(dict(module._parameters))
        weight = kept[-1]["weight"]
        if weight.requires_grad and torch.is_grad_enabled() and hasattr(weight, "placements"):
            module._parameters["weight"] = _AsParameter.apply(weight)

    module.register_forward_pre_hook(split)
    module.register_forward_hook(lambda module, args, output: module._parameters.update(kept.pop()))


# The dimension each splitting style cuts a weight along (torch's Colwise: Shard(0); Rowwise: Shard(1) of a Linear,
# Shard(0) of an Embedding); a module left whole holds it whole.
_WEIGHT_SPLIT = {"colwise": 0, "colwise_gather_output": 0, "rowwise": 1, "embedding_rowwise": 0}


def _ties(model: nn.Module, planned: dict[str, str], size: int) -> list[list[tuple[nn.Module, str]]]:
    """The (module, parameter name) groups sharing one parameter where the plan splits one of them; refused in one
    line where they would be split differently (or one whole)."""
    groups: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for key, param in module._parameters.items():
            if param is not None and all(module is not each for _, each, _ in groups.get(id(param), [])):
                groups.setdefault(id(param), []).append((name, module, key))
    ties = []
    for group in (group for group in groups.values() if len(group) > 1):
        splits = {(_WEIGHT_SPLIT.get(planned.get(name)) if key == "weight" else None) for name, _, key in group}
        if splits == {None} and not any(name in planned for name, _, _ in group):
            continue
        if len(splits) > 1 or any(planned.get(name) in ("sequence_parallel", "replicated_with_grad_allreduce")
                                  for name, _, _ in group):
            names = " and ".join(f"{name}.{key} ({planned.get(name, 'whole')})" for name, _, key in group)
            raise ConfigError(f"dist.tensor_parallel = {size}: {type(model).__name__} ties {names}, which the plan "
                              "lays out differently; give them one style, untie them, or use --set "
                              "dist.tensor_parallel=1")
        ties.append([(module, key) for _, module, key in group])
    return ties


class _SummedGradients(torch.autograd.Function):
    """The identity forward; backward, the gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReplicatedWithGradAllReduce(ParallelStyle):
    """transformers' "replicated_with_grad_allreduce": the module's parameters whole on every rank of the group, its
    parameter gradients summed over the group. transformers puts it on norms between a colwise and a rowwise layer
    (Qwen3's per-head q_norm and k_norm), which see only this rank's heads: each rank's gradient is its heads' part,
    so leaving the module whole (right for a norm on the replicated residual stream, whose gradient is the same on
    every rank of the group) would let the ranks' copies drift apart. The sum is taken in autograd, on the parameter
    as the module uses it (FSDP2's unsharded one), before FSDP2 reduce-scatters it over the data-parallel dimensions:
    transformers' post-accumulate hook never fires on FSDP2's parameters."""

    def _apply(self, module: nn.Module, tp_mesh) -> nn.Module:
        group = tp_mesh.get_group()
        kept: list[dict] = []

        def summed(module, args):
            kept.append(dict(module._parameters))
            module._parameters.update({key: _SummedGradients.apply(param, group) for key, param in kept[-1].items()
                                       if param is not None and param.requires_grad and torch.is_grad_enabled()})

        module.register_forward_pre_hook(summed)
        module.register_forward_hook(lambda module, args, output: module._parameters.update(kept.pop()))
        return module


# torch's DTensor logs, per process and per (mesh, dims, reason), "While redistributing from (_StridedShard(dim=0,
# sf=2), Shard(dim=0)) to (Replicate(), Replicate()), 2 sequential all_gather operations will be performed. This is
# suboptimal: ..." (about 450 characters) when a fsdp x tp parameter is gathered whole, for a checkpoint or an export:
# 16 lines at world size 8. Nothing in a config changes it, and it says nothing rank-specific: rank 0 says it once.


class _FirstOnRank0:
    """A logging filter: the first "While redistributing" record of rank 0 passes; the later ones, and every other
    rank's, do not. torch's other DTensor records pass."""

    def __init__(self):
        self.said = False

    def filter(self, record) -> bool:
        if not str(record.msg).startswith("While redistributing from"):
            return True
        import torch.distributed as dist

        first = not self.said and (not dist.is_initialized() or dist.get_rank() == 0)
        self.said = True
        return first


def quiet_redistribute_warning() -> None:
    """Installs _FirstOnRank0 on torch's redistribute logger, once per process."""
    import logging

    logger = logging.getLogger(REDISTRIBUTE_LOGGER)
    if not any(isinstance(each, _FirstOnRank0) for each in logger.filters):
        logger.addFilter(_FirstOnRank0())
