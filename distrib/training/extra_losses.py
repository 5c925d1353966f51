"""A model's extra losses: its outputs' keys ending in "loss" but "loss" itself (a mixture of experts' aux_loss), found
on the dry batch; each step's share of them for the log and, beside a built-in train.loss, for the backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from distrib.training.losses import Loss


def _fields(outputs) -> dict:
    """A model output's named parts: a dict's (a Hugging Face ModelOutput is one) or an object's attributes."""
    if isinstance(outputs, dict):
        return outputs
    if isinstance(outputs, (torch.Tensor, list, tuple)) or not hasattr(outputs, "__dict__"):
        return {}
    return vars(outputs)


def _scalar(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def extra_names(outputs) -> tuple[str, ...]:
    """The names of the scalar losses a model returns beside its main one (none from a tensor or a tuple)."""
    return tuple(name for name, value in _fields(outputs).items()
                 if isinstance(name, str) and name != "loss" and name.endswith("loss") and _scalar(value))


def _rank0s(names: tuple[str, ...]) -> tuple[str, ...]:
    """Rank 0's names on every rank: the agreement's all-reduce carries one value per name, so all need the same
    list (a collective: every rank calls it, once, after its dry batch)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return names
    box = [names]
    dist.broadcast_object_list(box, src=0)
    return tuple(box[0])


class ExtraLosses:
    """The extra losses of a run, by the names its dry batch showed. A step adds each micro-batch's value / (micro
    steps x pieces) to `sums` (this rank's share, as step_loss normalises a batch-mean loss); the rank agreement's
    all-reduce turns them into the global batch's means (`agreed`). `added`: they join the loss to backward (a
    built-in train.loss, and no loss of the model's own)."""

    def __init__(self, names: tuple[str, ...] = (), added: bool = False):
        self.names, self.added = names, added
        self.sums: torch.Tensor | None = None  # this rank's shares in the step under way
        self.agreed: torch.Tensor | None = None  # the global means, as of the last sync step

    @classmethod
    def of(cls, outputs, loss: Loss, logged: bool = True) -> ExtraLosses:
        """From the dry batch's outputs and the loss trained (logged False: none, e.g. under pipeline parallel)."""
        return cls(_rank0s(extra_names(outputs)) if logged else (), added=loss.elementwise is not None)

    def start(self, device: torch.device) -> None:
        self.sums = torch.zeros(len(self.names), device=device) if self.names else None

    def take(self, outputs, share: float) -> torch.Tensor | None:
        """Adds a micro-batch's (or piece's) values x share to the step's sums; their sum x share when `added`."""
        fields, found = _fields(outputs), []
        for index, name in enumerate(self.names):
            value = fields.get(name)
            if _scalar(value):  # a model may leave one out in some steps: it counts 0 there
                self.sums[index] += value.detach().float() * share
                found.append(value)
        return sum(found) * share if self.added and found else None

    def logged(self) -> dict[str, float]:
        """{name: the global mean at the last sync step} for a log step (a host read)."""
        return dict(zip(self.names, self.agreed.tolist())) if self.agreed is not None else {}

    def note(self, loss: Loss) -> str:
        """The log's line on what the run does with them ('' when there are none)."""
        if not self.names:
            return ""
        names = ", ".join(self.names)
        if self.added:
            return (f"training loss = {loss.name} + {' + '.join(self.names)} (the model's extra outputs, each also "
                    "logged on its own)")
        if loss.whole:
            return f"{names}: logged on its own; train.loss {loss.name!r} receives the outputs whole and decides"
        return (f"{names}: logged on its own; the model's own outputs.loss is trained as it is (a transformers MoE "
                "adds router_aux_loss_coef x aux_loss to it)")
