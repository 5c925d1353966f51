"""An exponential moving average (EMA) of a model's weights: updated after every optimizer step on every rank,
checkpointed, swapped in for an evaluation, and written as run_dir/model_ema.pt.

It averages whatever tensors the unwrapped model's state_dict holds: plain tensors under DDP, and under FSDP the
sharded DTensors, each rank averaging its own shard (a lerp of local tensors, no communication)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from distrib.errors import UserError
from distrib.torch_private import foreach_lerp_


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, or the tensor itself; shares storage with it."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _like(saved: torch.Tensor, shadow: torch.Tensor) -> torch.Tensor:
    """A whole saved tensor (a one-file checkpoint) as this rank's shard where the average is sharded (FSDP)."""
    if hasattr(shadow, "device_mesh") and not hasattr(saved, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank holds the whole tensor and keeps its own slice, no communication.
        return distribute_tensor(saved.to(shadow.device), shadow.device_mesh, shadow.placements, src_data_rank=None)
    return saved


class EMA:
    """ema = decay * ema + (1 - decay) * weights after each step, starting from the initial weights. Floating
    parameters and buffers are averaged; integer buffers (BatchNorm's num_batches_tracked) are copied."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        # The live tensors, once: the optimizer updates them in place, as it does the very objects in its own list.
        live = model.state_dict(keep_vars=True)
        self.names = list(live)
        with torch.no_grad():
            self._live = [_local(t.detach()) for t in live.values()]
            self.shadow = {name: t.detach().clone() for name, t in live.items()}
            self._average = [_local(self.shadow[name]) for name in self.names]  # ours: only ever written in place
        self._averaged = [i for i, t in enumerate(self._live) if t.is_floating_point()]
        self._copied = [i for i, t in enumerate(self._live) if not t.is_floating_point()]

    def _pairs(self, indices):
        return [self._average[i] for i in indices], [self._live[i] for i in indices]

    @torch.no_grad()
    def update(self) -> None:
        averages, weights = self._pairs(self._averaged)
        if averages:
            foreach_lerp_(averages, weights, 1.0 - self.decay)  # one fused kernel per device and dtype
        for average, value in zip(*self._pairs(self._copied)):
            average.copy_(value)

    @torch.no_grad()
    def reset(self) -> None:
        """Restarts the average at the current weights (a resumed run that had no EMA before)."""
        for average, value in zip(*self._pairs(range(len(self.names)))):
            average.copy_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.names):
            raise UserError(f"the checkpoint's EMA weights do not fit the model (they differ in "
                            f"{sorted(set(state) ^ set(self.names))[:3]}); resume the model they were taken from")
        for name in self.names:
            _local(self.shadow[name]).copy_(_local(_like(state[name], self.shadow[name])))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors on the CPU, for model_ema.pt. Sharded (DTensor) entries are gathered: a collective, so
        every rank calls this."""
        return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
                for name, t in self.shadow.items()}

    @contextlib.contextmanager
    def swapped_in(self):
        """The model holds the EMA weights inside the block and its own, bit for bit, after it."""
        with torch.no_grad():
            saved = [t.clone() for t in self._live]
            for average, value in zip(*self._pairs(range(len(self.names)))):
                value.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for value, kept in zip(self._live, saved):
                    value.copy_(kept)
