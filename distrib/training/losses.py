"""The training loss, from where the user puts it: the model's own (`outputs.loss`, the Hugging Face convention), a
built-in train.loss (cross_entropy over samples or positions, mse, l1, bce_with_logits), or the user's function; and
the per-position form of the built-ins, for exact evaluation sums."""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distrib.config import TrainConfig
from distrib.data import samples
from distrib.distributed.parallel import unwrap
from distrib.factory import import_object

LossFn = Callable[[object, torch.Tensor], torch.Tensor]  # (the model's outputs, whole; targets) -> the batch mean
IGNORE_INDEX = -100  # a class target that counts for nothing (PyTorch's default ignore_index, Hugging Face's labels)
BUILTIN = ("cross_entropy", "mse", "l1", "bce_with_logits")


def forward(model, inputs):
    """The model on a batch's inputs, as they are: model(inputs), or model(**inputs) for a dict, whose "labels" stay
    out when forward takes none (they are the targets: the loss gets them)."""
    if not isinstance(inputs, dict):
        return model(inputs)
    if samples.LABELS in inputs and not takes(model, samples.LABELS):
        inputs = {key: value for key, value in inputs.items() if key != samples.LABELS}
    if "position_ids" in inputs and getattr(getattr(unwrap(model), "config", None), "use_cache", None) is not None \
            and takes(model, "use_cache"):
        # Packed documents (distrib.data.documents) into a transformers model (or a peft wrapper of one): it masks
        # each document from the restarting position_ids only without a KV cache, which it otherwise makes even in
        # training.
        inputs = {**inputs, "use_cache": False}
    return model(**inputs)


def takes(model, key: str) -> bool:
    """Whether the plain module's forward (under DDP or torch.compile) takes `key` (by name, or as **kwargs)."""
    return _forward_takes(type(unwrap(model)), key)


@functools.cache
def _forward_takes(module_class: type, key: str) -> bool:
    """By the class: every step asks, and a signature is read once."""
    parameters = inspect.signature(module_class.forward).parameters
    return key in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def own_loss(outputs) -> torch.Tensor | None:
    """The loss a model computed itself: outputs.loss or outputs["loss"] (a Hugging Face ModelOutput has both)."""
    if isinstance(outputs, torch.Tensor):
        return None
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def logits_of(outputs):
    """What losses and metrics see: the output tensor, or a model output's logits (attribute or key)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else outputs


def class_dim(logits: torch.Tensor, targets: torch.Tensor) -> int | None:
    """Where the classes are: 1 for [B, C] logits of [B] targets, -1 for [B, ..., C] logits of [B, ...] targets (the
    preferred layout), 1 for [B, C, ...] logits of [B, ...] targets (PyTorch's); None when they do not pair."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != targets.dim() + 1 or len(logits) != len(targets):
        return None
    if targets.dim() == 1:
        return 1
    if logits.shape[:-1] == targets.shape:
        return -1
    return 1 if logits.shape[2:] == targets.shape[1:] else None


def _flat(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, C] logits and [M] targets over every position (unchanged for [B, C] and [B])."""
    if targets.dim() == 1:
        return logits, targets
    if class_dim(logits, targets) == 1:
        logits = logits.movedim(1, -1)
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)


class Loss:
    """A training loss. Built-ins have an `elementwise` form (one value per counted target position, 0 where not
    counted) and a `count` of counted positions, so evaluation sums exactly and training weights micro-batches by
    what they count; a user's function (`whole`) has only its batch mean, weighted by samples, and receives the
    model's outputs whole; `model` takes outputs.loss."""

    def __init__(self, name: str, batch_mean: LossFn, elementwise: LossFn | None = None,
                 ignore_index: int | None = None, needs: Callable[[torch.Tensor], str] | None = None,
                 whole: bool = False):
        self.name = name
        self.batch_mean = batch_mean
        self.elementwise = elementwise
        self.ignore_index = ignore_index
        self.needs = needs  # targets -> the outputs this loss needs for them, as words (built-ins)
        self.whole = whole  # the outputs as the model returned them (a user's function), not their logits

    def __call__(self, outputs, targets) -> torch.Tensor:
        """The batch mean (over counted positions for built-ins)."""
        own = own_loss(outputs) if self.name == "model" else None
        return own if own is not None else self.batch_mean(self.given(outputs), targets)

    def given(self, outputs):
        """What the loss function receives: the outputs whole (a user's), or their logits (a built-in's)."""
        return outputs if self.whole else logits_of(outputs)

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        if self.ignore_index is not None:
            return (targets != self.ignore_index).sum()
        return torch.tensor(targets.numel(), device=targets.device)

    def counts_vary(self, targets) -> bool:
        """Whether micro-batches of one shape may count different numbers of positions (dense class targets, where
        some may be ignore_index): then the step divides by the global count, not by a mean of means."""
        return self.ignore_index is not None and isinstance(targets, torch.Tensor) and targets.dim() > 1

    def total(self, outputs, targets) -> torch.Tensor:
        """The sum over counted positions (built-ins only)."""
        return self.elementwise(logits_of(outputs), targets).sum()

    def fits(self, logits, targets) -> bool:
        if self.needs is None:
            return True
        if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
            return False
        if self.ignore_index is not None:
            return class_dim(logits, targets) is not None and not targets.is_floating_point()
        return logits.shape == targets.shape


class Extras(Protocol):
    """What step_loss needs of the model's extra losses (training/extra_losses.py's ExtraLosses, which imports this
    module: the protocol keeps the import one way)."""

    names: tuple[str, ...]

    def take(self, outputs, share: float) -> torch.Tensor | None: ...


def step_loss(loss: Loss, targets: list, shares: int, extras: Extras | None = None
              ) -> Callable[[object, object, int], torch.Tensor]:
    """The one place a step's loss is normalised: (outputs, targets, pieces) -> the loss to backward for one of
    `pieces` equal pieces of one of the step's micro-batches (`targets`: each micro-batch's), such that the gradients
    summed over micro-batches and pieces, then averaged over the batch mesh by DDP's or FSDP's reduction, are those
    of the mean loss of the global batch. shares: how many shares of the step's loss the world backwards
    (Runner.loss_shares: the world size, times C under context parallel, whose ranks each backward a share of the
    micro-batch they all count whole). Losses whose counts vary divide each piece's sum by the global count
    (global_count_scale); the others average equal pieces' means. The model's extra losses (extras) are batch means
    of their own: each piece's value / (micro-steps x pieces), summed for the log, and added where extras.added."""
    scale = global_count_scale(loss, targets, shares)
    micro_steps = len(targets)
    if scale is not None:
        def main(outputs, piece_targets, pieces):
            return loss.total(outputs, piece_targets) * scale
    else:
        def main(outputs, piece_targets, pieces):
            return loss(outputs, piece_targets) / (micro_steps * pieces)
    if extras is None or not extras.names:
        return main

    def with_extras(outputs, piece_targets, pieces):
        value = main(outputs, piece_targets, pieces)
        added = extras.take(outputs, 1 / (micro_steps * pieces))
        return value if added is None else value + added

    return with_extras


def global_count_scale(loss: Loss, targets: list, shares: int) -> torch.Tensor | None:
    """shares / (positions counted in the whole global batch), for losses whose counts vary; None otherwise.
    One all-reduce on every rank of every step where it applies (all ranks hold the same kind of targets). Under
    tensor and pipeline parallelism each group's ranks add the same count (every stage reads the targets), so the
    sum and the shares (the world size, Runner.loss_shares) are both tp x pp times the batch mesh's, and the ratio is
    the batch mesh's size over the global count, as the gradient mean needs; under context parallel the C ranks of a
    group add the same whole count too, and the shares are C x the world size: each rank's piece is C x its part of
    the micro-batch's sum, the C parts of one loss (dimensions.context: loss_count)."""
    if not loss.counts_vary(targets[0]):
        return None
    total = torch.stack([loss.count(t) for t in targets]).sum()
    if shares > 1:  # more than one rank (C > 1 only among them)
        dist.all_reduce(total)
    return (shares / total.clamp(min=1)).float()


def cross_entropy(label_smoothing: float = 0.0) -> Loss:
    def batch_mean(logits, targets):
        return F.cross_entropy(*_flat(logits, targets), label_smoothing=label_smoothing, ignore_index=IGNORE_INDEX)

    def elementwise(logits, targets):
        return F.cross_entropy(*_flat(logits, targets), reduction="none", label_smoothing=label_smoothing,
                               ignore_index=IGNORE_INDEX)

    def needs(targets):
        if targets.dim() == 1:
            return f"[{len(targets)}, C] (one logit per class)"
        return f"[{', '.join(str(s) for s in targets.shape)}, C] (one logit per class at each position)"

    return Loss("cross_entropy", batch_mean, elementwise, IGNORE_INDEX, needs)


def _pointwise(name: str, fn) -> Loss:
    """A loss of outputs and targets of one shape, averaged over every element (integer targets count as floats)."""
    def elementwise(outputs, targets):
        return fn(outputs, targets.to(outputs.dtype), reduction="none")

    def batch_mean(outputs, targets):
        return fn(outputs, targets.to(outputs.dtype))

    def needs(targets):
        return f"[{', '.join(str(s) for s in targets.shape)}] (the targets' shape)"

    return Loss(name, batch_mean, elementwise, None, needs)


def _missing(logits, targets):
    raise TypeError("the model returned no loss on this batch (outputs.loss), though it did on the first one")


class CountedModelLoss(Loss):
    """The model's own outputs.loss where it is the mean cross-entropy over the counted target positions (labels not
    -100; shifted by one for a causal LM, as Hugging Face's shift them): its sum is the mean x that count, so a step
    divides by the global count, as for the built-in cross-entropy, and padded micro-batches of any length agree."""

    def __init__(self, shift: bool):
        super().__init__("model", _missing, ignore_index=IGNORE_INDEX)
        self.shift = shift

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return ((targets[:, 1:] if self.shift else targets) != IGNORE_INDEX).sum()

    def total(self, outputs, targets) -> torch.Tensor:
        return self(outputs, targets) * self.count(targets)

    def fits(self, logits, targets) -> bool:
        return False  # no elementwise form: evaluation sums total()


def _counts_positions(outputs, targets) -> bool | None:
    """Whether the model's own loss (on the dry batch) is the mean cross-entropy of its logits over the labels'
    counted positions shifted by one (True) or in place (False, a masked LM's); None when it is neither."""
    logits, own = logits_of(outputs), own_loss(outputs)
    if not (isinstance(logits, torch.Tensor) and isinstance(targets, torch.Tensor) and targets.dim() == 2
            and logits.dim() == 3 and logits.shape[:2] == targets.shape and not targets.is_floating_point()):
        return None
    for shift in (True, False):
        pairs = (logits[:, :-1], targets[:, 1:]) if shift else (logits, targets)
        if not (pairs[1] != IGNORE_INDEX).any():
            continue
        mean = F.cross_entropy(*_flat(pairs[0].float(), pairs[1]), ignore_index=IGNORE_INDEX)
        if torch.allclose(mean, own.detach().float(), rtol=1e-4, atol=1e-6):
            return shift
    return None


def model_loss(outputs=None, targets=None) -> Loss:
    """The model's own outputs.loss: counted by positions where the dry batch shows it is a mean over them (see
    CountedModelLoss), else a batch mean of its making, weighted by samples in evaluation."""
    shift = _counts_positions(outputs, targets) if outputs is not None else None
    return Loss("model", _missing) if shift is None else CountedModelLoss(shift)


def build_loss(config: TrainConfig, loss_fn: LossFn | None = None) -> Loss:
    """train.loss (or, from distrib.fit, a function given in Python, which wins)."""
    if loss_fn is not None:
        return Loss(getattr(loss_fn, "__name__", type(loss_fn).__name__), loss_fn, whole=True)
    if config.loss == "cross_entropy":
        return cross_entropy(config.label_smoothing)
    pointwise = {"mse": F.mse_loss, "l1": F.l1_loss, "bce_with_logits": F.binary_cross_entropy_with_logits}
    if config.loss in pointwise:
        return _pointwise(config.loss, pointwise[config.loss])
    return Loss(config.loss, import_object("train.loss", config.loss), whole=True)


def describe(tree) -> str:
    """A batch's or a model output's structure in words: 'int64 [2, 16]', '{logits: float32 [2, 16, 32], ...}'."""
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{key}: {describe(value)}" for key, value in tree.items()) + "}"
    if isinstance(tree, (list, tuple)):
        return "(" + ", ".join(describe(value) for value in tree) + ")"
    return samples.kind(tree, rows=True) if tree is None or isinstance(tree, torch.Tensor) else type(tree).__name__
