"""What a restarted replica group heals from: a live group's training state, sent rank to rank (torchft pairs rank r
of each group) as plain local tensors, and taken back into this rank's own layout (DTensors where it holds them)."""

from __future__ import annotations

import torch

from distrib.distributed.parallel import local_tensor
from distrib.distributed.runtime import Runtime

# Parts of the training state that belong to one group's folders and trackers, not sent to a healing group.
_OWN_PARTS = ("trackers", "best")


def _local(tree):
    """A state whose DTensors (this rank's shards) are plain tensors, copied: what goes to a healing group's same rank,
    which holds the same shards."""
    if isinstance(tree, dict):
        return {key: _local(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(value) for value in tree)
    return local_tensor(tree).detach().clone() if isinstance(tree, torch.Tensor) else tree


def _like(tree, template):
    """A received state's local tensors back as DTensors where this rank's own state (template) holds DTensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict) and isinstance(template, dict):
        return {key: _like(value, template.get(key)) for key, value in tree.items()}
    if isinstance(template, DTensor):
        return DTensor.from_local(tree, template.device_mesh, template.placements, shape=template.shape,
                                  stride=template.stride())
    return tree


def sent_state(state, global_batch_size: int, runtime: Runtime, group: int) -> dict:
    """What a healing group loads (called in torchft's quorum thread while the main thread waits for the quorum):
    the training state, copied, this rank's RNG, and which group sent it."""
    train = state.state_dict(global_batch_size)
    for part in _OWN_PARTS:
        train.pop(part, None)
    return {"train": _local(train), "rng": runtime.rng_state(), "group": group}


def take_state(state, global_batch_size: int, runtime: Runtime, received: dict) -> int:
    """A live group's sent_state loaded into this rank's own state and RNG; returns the group that sent it."""
    train = received["train"]
    if state.strategy.sharded_state:
        train = _like(train, state.state_dict(global_batch_size))
    state.load_state_dict(train, global_batch_size)
    runtime.set_rng_state(received["rng"])
    return received["group"]
