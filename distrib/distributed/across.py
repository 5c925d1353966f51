"""What a training step agrees on with ranks outside its own world (StepAcross; today fault-tolerant replica groups'
quorum, all-reduce and commit), and the stop when no step can be agreed any more (AgreementLost). The trainer holds
one or none and names no degree; a degree's declaration (distrib.distributed.dimensions.around_training) makes it
around the training steps."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn


class AgreementLost(Exception):
    """No step can be agreed with the other worlds any more: the trainer checkpoints and stops with the preemption's
    code (its launcher's restart, or a rerun, resumes there). The message is the line the log says why in."""


class StepAcross(Protocol):
    """Each try of an optimizer step, made with the other worlds: every rank of this world makes the same calls."""

    def start_step(self) -> bool:
        """Before the try; True when it replaced the training state (a heal from a live world): the caller reads on
        from the state's progress. AgreementLost when no step can be agreed any more."""

    def average(self, model: nn.Module, local_loss: torch.Tensor) -> torch.Tensor:
        """The gradients (and this rank's loss, returned) averaged over the worlds that take part in the try."""

    def commit(self) -> bool:
        """Whether the try went through in every world: the update is taken only then, else the try is taken again."""

    @property
    def share(self) -> float:
        """The part of the global batch this step's worlds read (the throughput's count)."""

    def logged(self) -> dict:
        """What a logged step's record says of it."""

    def training_ended(self, step: int, stop_reason: str) -> None:
        """After the last step and the final checkpoint, before the final evaluation (which the other worlds may
        wait for): the trainer's stop_reason ("completed", "early_stop")."""
