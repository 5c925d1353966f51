"""Optimizer choices a transformer needs: parameter groups without weight decay on biases, norms and embeddings (as
nanoGPT and torchtitan make them), torch's optimizers stepped in chunks (temporaries bounded), and the user's
`train.optimizer = "package.module:function"`; the optimizer and learning-rate schedule a run builds from them."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn as nn

from distrib.config import TrainConfig
from distrib.distributed.parallel import local_tensor
from distrib.errors import ConfigError, UserError
from distrib.factory import import_object
from distrib.torch_private import BatchNormBase, InstanceNormBase

_NO_DECAY_MODULES = (nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
                     BatchNormBase, InstanceNormBase)


def _not_decayed(model: nn.Module) -> set[int]:
    """Ids of biases and other vectors, and of every parameter of a norm or embedding layer (a weight tied to an
    embedding too: decaying it through the output layer would decay the embedding)."""
    found = {id(p) for p in model.parameters() if p.dim() < 2}
    for module in model.modules():
        if isinstance(module, _NO_DECAY_MODULES) or "Norm" in type(module).__name__:
            found |= {id(p) for p in module.parameters(recurse=False)}
    return found


def param_groups(model: nn.Module, config: TrainConfig, log: Callable[[str], None]) -> list:
    """[{decayed}, {not decayed, weight_decay 0}] when weight decay is on and train.decay = weights; else the plain
    parameter list. Logs the groups it made in one line."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not config.weight_decay or config.decay == "all":
        return params
    skip = _not_decayed(model)
    decayed = [p for p in params if id(p) not in skip]
    kept = [p for p in params if id(p) in skip]
    log(f"{config.optimizer} parameter groups: weight decay {config.weight_decay:g} on {len(decayed)} weight "
        f"tensors ({sum(p.numel() for p in decayed):,} values), none on {len(kept)} biases, norms and embeddings "
        f"({sum(p.numel() for p in kept):,} values); --set train.decay=all decays every parameter")
    return [{"params": decayed}, {"params": kept, "weight_decay": 0.0}]


# torch's foreach optimizers make temporaries the size of everything they step at once (AdamW: the gradients scaled by
# 1 - beta2, the second moments' square roots): a quarter of the model on each fsdp rank at world size 4, measured
# 0.25x the model above the step's state on a 25M GPT. In chunks of at least this many elements, and at most 8 chunks
# a group, they stay under an eighth of that, with bitwise the same update (every op is elementwise); a model of
# fewer elements per rank is stepped in one, as before.
MIN_CHUNK_ELEMENTS = 2**20
MAX_CHUNKS = 8


def _chunks(params: list) -> list[list]:
    sizes = [local_tensor(p).numel() for p in params]
    limit = max(MIN_CHUNK_ELEMENTS, -(-sum(sizes) // MAX_CHUNKS))
    chunks, current, filled = [], [], 0
    for param, size in zip(params, sizes):
        if current and filled + size > limit:
            chunks.append(current)
            current, filled = [], 0
        current.append(param)
        filled += size
    return chunks + [current] if current else chunks


@functools.cache  # one class per optimizer class
def chunked_steps(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """cls whose step runs each parameter group in chunks (_chunks): the groups' settings, the per-parameter state
    and the state_dict are cls's own; only the lists one foreach call sees are shorter."""

    class Chunked(cls):
        def step(self, closure=None):
            groups = self.param_groups
            self.param_groups = [{**group, "params": chunk} for group in groups for chunk in _chunks(group["params"])]
            try:
                return super().step(closure)
            finally:
                self.param_groups = groups

    Chunked.__name__, Chunked.__qualname__ = cls.__name__, cls.__qualname__
    return Chunked


def check_user_optimizer(config: TrainConfig) -> None:
    """Imports train.optimizer's function before anything is written (a wrong path is one line, exit 2)."""
    if config.optimizer not in ("sgd", "adam", "adamw"):
        import_object("train.optimizer", config.optimizer)


def user_optimizer(config: TrainConfig, groups: list) -> torch.optim.Optimizer:
    spec = config.optimizer
    function = import_object("train.optimizer", spec)
    try:
        optimizer = function(groups, config)
    except Exception as e:  # noqa: BLE001 - the user's function
        raise UserError(f"train.optimizer = {spec!r}: calling it with (parameter groups, config) raised "
                        f"{type(e).__name__}: {str(e).strip()[:160]}; fix the function") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(f"train.optimizer = {spec!r}: returned {type(optimizer).__name__}, not a "
                        "torch.optim.Optimizer; return one built over the parameters it is given")
    return optimizer


def build_optimizer(model: nn.Module, config: TrainConfig, log: Callable[[str], None] | None = None
                    ) -> torch.optim.Optimizer:
    """train.optimizer over the model's parameters; adam and adamw in two groups when weight decay is on, so that
    biases, norms and embeddings are not decayed (train.decay = weights); a user's function gets those groups."""
    # foreach: one op over all parameters, PyTorch's default on GPUs, here on CPUs too, where its loop over parameters
    # (bitwise the same) pays a dispatch per op and parameter: AdamW on the bench GPT 34 -> 10 ms a step under fsdp.
    # In chunks (optimizers.chunked_steps), so that its temporaries are not the size of the whole local model.
    if config.optimizer == "sgd":
        trainable = [param for param in model.parameters() if param.requires_grad]  # frozen ones get no state
        return chunked_steps(torch.optim.SGD)(trainable, lr=config.lr, momentum=config.momentum,
                                              weight_decay=config.weight_decay, foreach=True)
    groups = param_groups(model, config, log or (lambda message: None))
    if config.optimizer in ("adam", "adamw"):
        cls = chunked_steps(torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW)
        return cls(groups, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay, foreach=True)
    return user_optimizer(config, groups)


def lr_factor(step: int, total_steps: int, config: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then constant or cosine decay to zero at total_steps."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer, total_steps: int | None, config: TrainConfig):
    """The schedule spans train.schedule_steps when set (so a run extended later continues the same curve), else
    this run's total_steps (an extended run then recomputes it: the cosine jumps back up). total_steps None: a stream
    trained by passes, whose schedule needs no length (constant) or has train.schedule_steps (distrib.worker)."""
    length = config.schedule_steps or total_steps or 0
    if config.schedule == "cosine" and total_steps is not None and length < total_steps:
        raise ConfigError(f"train.schedule_steps = {config.schedule_steps}: shorter than this run's {total_steps} "
                          f"steps, so the learning rate would be 0 after step {length}; set it to {total_steps} or "
                          "more, or to 0 (the run's length)")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, length, config))
