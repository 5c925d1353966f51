"""Tensor parallel (dist.tensor_parallel): torch's parallelize_module on the mesh's innermost dimension, with the
plan the model declares as `_tp_plan` (module names, `*` for any index -> "colwise" | "rowwise"; the convention of
Hugging Face's `base_model_tp_plan`). The built-in GPT's: q/k/v and the MLP's input projections column-wise, the
attention and MLP output projections row-wise, so each block does one all-reduce in forward and one in backward per
sub-layer; norms, embedding and output stay whole on every rank of the group (FSDP shards them over the others)."""

from __future__ import annotations

import math
from fnmatch import fnmatch

import torch.nn as nn

from distrib.distributed.mesh import divisors, either
from distrib.errors import ConfigError

STYLES = ("colwise", "rowwise")
# What a refused style's message tells the factory to write: the plan's colwise and rowwise entries alone (the modules
# of the others, e.g. transformers' lm_head 'colwise_gather_output' and embed_tokens 'embedding_rowwise', then stay
# whole on every rank of the group, sharded by fsdp over the others).
KEEP_SUPPORTED = "model._tp_plan = {name: style for name, style in model._tp_plan.items() if style in ('colwise', " \
                 "'rowwise')}"


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


def tensor_parallel_plan(model: nn.Module, size: int, ranks: int | None = None) -> dict[str, str]:
    """The model's declared plan, checked: every entry a style distrib applies, naming Linear layers whose split
    dimension divides by size; and its attention heads (attention_heads) divisible by size (ranks: as check_heads)."""
    plan = getattr(model, "_tp_plan", None)
    name = type(model).__name__
    if not plan:
        raise ConfigError(f"dist.tensor_parallel = {size}: the model ({name}) declares no tensor-parallel plan "
                          "(a _tp_plan of module names -> colwise/rowwise, as the built-in GPT's); use --set "
                          "dist.tensor_parallel=1, or model.name = gpt")
    check_heads(name, attention_heads(model), size, ranks)  # first: the degree is the fix to make before any other
    for pattern, style in plan.items():
        if style not in STYLES:  # transformers' own styles: its colwise and rowwise entries serve as they are
            raise ConfigError(f"dist.tensor_parallel = {size}: {name}._tp_plan entry {pattern!r}: {style!r} is not "
                              "a style distrib applies (colwise and rowwise only); in the model factory keep those "
                              f"entries alone, {KEEP_SUPPORTED} (the others' modules stay whole on every rank of the "
                              "group), or use --set dist.tensor_parallel=1")
    for pattern, style in plan.items():
        _check_entry(model, name, pattern, style, size)
    return plan


def _check_entry(model: nn.Module, name: str, pattern: str, style: str, size: int) -> None:
    matched = [(n, m) for n, m in model.named_modules() if fnmatch(n, pattern)]
    if not matched:
        raise ConfigError(f"dist.tensor_parallel = {size}: {name}._tp_plan entry {pattern!r}: names no module of the "
                          "model; name its modules as named_modules() gives them (`*` for any index)")
    for module_name, module in matched:
        if not isinstance(module, nn.Linear):
            raise ConfigError(f"dist.tensor_parallel = {size}: {name}._tp_plan entry {pattern!r}: {module_name} is a "
                              f"{type(module).__name__}; colwise and rowwise split nn.Linear layers only")
        width = module.out_features if style == "colwise" else module.in_features
        if width % size:
            raise ConfigError(f"dist.tensor_parallel = {size}: {module_name} ({width} wide) cannot be split {size} "
                              f"ways; use a divisor of {width} (and of the attention heads)")


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
    quiet_redistribute_warning()
    return parallelize_module(model, tp_mesh, {pattern: styles[style]() for pattern, style in plan.items()})


# torch's DTensor logs, per process and per (mesh, dims, reason), "While redistributing from (_StridedShard(dim=0,
# sf=2), Shard(dim=0)) to (Replicate(), Replicate()), 2 sequential all_gather operations will be performed. This is
# suboptimal: ..." (about 450 characters) when a fsdp x tp parameter is gathered whole, for a checkpoint or an export:
# 16 lines at world size 8. Nothing in a config changes it, and it says nothing rank-specific: rank 0 says it once.
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


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
