"""What the ranks decide together at a step boundary: the global mean loss (and the model's extra losses), whether any
rank was asked to stop, and whether any gradient went non-finite since the last agreement; one small all-reduce
carries them all."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distrib.launch.preempt import StopFlag
from distrib.torch_private import amp_foreach_non_finite_check_and_unscale_


@dataclass(frozen=True)
class Agreed:
    """The outcome of one agreement, the same on every rank."""

    loss: torch.Tensor  # the loss averaged over the global batch (a device scalar: reading it is a host sync)
    nonfinite_since: int | None  # the first step the non-finite gradients may be from, or None: all finite
    extras: torch.Tensor | None = None  # the extra losses' global means, in the order they were given


class RankAgreement:
    """Collects this rank's votes between sync steps without any host read, and agrees on them in one all-reduce.
    Only on sync steps: per step, its latency and host sync cost 7-13% of a small model's step on a shared CPU."""

    def __init__(self, stop: StopFlag, device: torch.device, world_size: int, synced_at: int = 0,
                 loss_ranks: int | None = None):
        self.stop = stop  # set by a signal handler
        self.world_size = world_size
        # The ranks that hold a loss: all, but under pipeline parallel only the last stage's (the others add 0).
        self.loss_ranks = loss_ranks or world_size
        self.synced_at = synced_at  # the last step agreed on
        self.stop_agreed = False  # some rank got a stop signal: all checkpoint and stop at the end of this step
        # A device-side flag, set by any finite check since the last agreement: no host sync of its own, which on an
        # accelerator would stall the queue of work every step.
        self.nonfinite = torch.zeros((), device=device)
        self._one = torch.ones((), device=device)

    def check_finite(self, grads: list[torch.Tensor]) -> None:
        """Sets the flag if any gradient has a non-finite entry, in GradScaler's fused check (grads x 1.0, unchanged):
        one pass over the gradients per dtype; on a CPU a seventh of the cost of norms, stack, isfinite and all."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), same_kind in groups.items():
            if device == self.nonfinite.device:
                amp_foreach_non_finite_check_and_unscale_(same_kind, self.nonfinite, self._one)
            else:  # dist.cpu_offload: FSDP's gradient shards in host memory, a flag of their own there
                found = torch.zeros((), device=device)
                amp_foreach_non_finite_check_and_unscale_(same_kind, found, torch.ones((), device=device))
                self.nonfinite += found.to(self.nonfinite.device)

    def agree(self, local_loss: torch.Tensor, step: int, extras: torch.Tensor | None = None) -> Agreed:
        """SUM, then divide by the ranks that hold a loss: the global mean of equal-sized micro-batches (each
        tensor-parallel rank holds its group's, so the sum counts it tp times, and so does the divisor); the same
        for this rank's shares of the extra losses (as many on every rank). Every rank must call it at the same
        step."""
        device = local_loss.device
        votes = torch.stack([local_loss.detach().float(), torch.full((), float(self.stop.requested), device=device),
                             self.nonfinite])
        if extras is not None:
            votes = torch.cat([votes, extras])
        dist.all_reduce(votes)
        stop, nonfinite = votes[1:3].tolist()  # the host sync, on sync steps only
        since = self.synced_at + 1 if nonfinite > 0 else None
        self.nonfinite.zero_()
        self.synced_at, self.stop_agreed = step, stop > 0
        return Agreed(votes[0] / self.loss_ranks, since, votes[3:] / self.loss_ranks if extras is not None else None)
