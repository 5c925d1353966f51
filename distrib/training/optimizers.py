"""Optimizer choices a transformer needs: parameter groups without weight decay on biases, norms and embeddings (as
nanoGPT and torchtitan make them), torch's optimizers stepped in chunks (temporaries bounded), and the user's
`train.optimizer = "package.module:function"`."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn

from distrib.config import TrainConfig
from distrib.distributed.parallel import local_tensor
from distrib.errors import UserError
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
