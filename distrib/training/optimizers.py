"""Optimizer choices a transformer needs: parameter groups without weight decay on biases, norms and embeddings (as
nanoGPT and torchtitan make them), and the user's `train.optimizer = "package.module:function"`."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from distrib.config import TrainConfig
from distrib.errors import UserError
from distrib.factory import import_object

_NO_DECAY_MODULES = (nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
                     nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


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
