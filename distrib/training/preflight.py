"""Before step 1: one dry batch of the training data through the placed model, so that a model that does not fit the
data fails with one line naming both shapes or the key (not a 70-line traceback or `Target 8 is out of bounds` at
step 1); it also says where the loss comes from and which metrics the task gets."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from distrib.data import DataInfo, samples
from distrib.distributed.compile import explain_compile_errors
from distrib.distributed.parallel import check_batch, explain_device_errors, unwrap
from distrib.errors import UserError
from distrib.factory import import_object
from distrib.training.evaluation import MetricFn, Task, task_of, user_metric
from distrib.training.losses import IGNORE_INDEX, Loss, class_dim, describe, forward, logits_of, model_loss, own_loss

DRY_BATCH_SIZE = 2


@dataclass(frozen=True)
class DryBatch:
    inputs: samples.Tree
    targets: samples.Tree | None
    outputs: object  # what the model returned
    loss: Loss  # the loss to train: the model's own if it returned one (unless a user's function), else the configured
    note: str = ""  # the log's line on where a dict sample's labels go, when not to forward


def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _check_keys(model: nn.Module, inputs) -> str:
    """A dict batch goes in as model(**batch): every key must be a parameter of forward (or it takes **kwargs), but
    "labels", which are then the targets only. Returns the log's line that says so, or ''."""
    if not isinstance(inputs, dict):
        return ""
    parameters = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return ""
    unknown = [key for key in inputs if key not in parameters and key != samples.LABELS]
    if unknown:
        raise UserError(f"the data's samples have the key {unknown[0]!r}, which {type(model).__name__}.forward"
                        f"({', '.join(parameters)}) does not take (dict samples go in as model(**batch)); fix: "
                        "drop or rename that key in the samples, or let forward take it")
    if samples.LABELS in inputs and samples.LABELS not in parameters:
        return (f"the samples' 'labels' are the targets: {type(model).__name__}.forward({', '.join(parameters)}) takes "
                "none, so they go to the loss, not to forward")
    return ""


def _run(model: nn.Module, inputs, info: DataInfo, device: torch.device):
    batch = samples.named(inputs, "inputs")
    try:
        # compiled blocks (speed.compile but under ddp) compile here, in the first forward
        with torch.no_grad(), explain_device_errors(model, device, batch), explain_compile_errors(model):
            return forward(model, inputs)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:  # the shape errors of layers, mostly
        said = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if "indices" in said and isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
            raise UserError(f"the model embeds integer ids, and the data's inputs are {describe(inputs)} (it raised "
                            f"{type(e).__name__}: {said}); fix: give int64 token ids (tensor.long()), or a model "
                            "for float features") from e
        wanted = _shape(info.input_shape) if len(info.input_shape) == 3 else info.inputs
        raise UserError(f"the model cannot take the data's inputs: on a batch of {describe(inputs)} ({info.name}"
                        + (f", {info.num_classes} classes" if info.num_classes else "")
                        + f") it raised {type(e).__name__}: {said}; make the model take {wanted} inputs"
                        + (" (a model.factory that declares in_channels and image_size gets them from the data)"
                           if len(info.input_shape) == 3 else "")) from e


def _first_batch(source):
    """The first samples of the training data (of a stream: its first ones), as (inputs, targets)."""
    indices = torch.arange(min(DRY_BATCH_SIZE, source.num_samples or DRY_BATCH_SIZE))  # None: a stream
    return next(iter(source.batches([indices])))


def dry_forward(source) -> Callable[[nn.Module], object]:
    """model -> its outputs on the dry batch's inputs, as training runs it (dist.find_unused_parameters = auto probes
    with it before DDP wraps the model: distrib.distributed.unused)."""
    return lambda model: forward(model, _first_batch(source)[0])


def dry_batch(model: nn.Module, source, info: DataInfo, device: torch.device, loss: Loss) -> DryBatch:
    """Runs the plain placed model on the first samples of `source` in eval mode without gradients (no dropout draws,
    no BatchNorm statistics, no RNG: the training that follows is bitwise what it would be without this), checks
    that its outputs fit the targets and the loss, and that class targets are in range."""
    inputs, targets = _first_batch(source)
    check_batch({**samples.named(inputs, "inputs"), **samples.named(targets, "targets")}, device)
    model = unwrap(model)
    note = _check_keys(model, inputs)
    was_training = model.training
    model.eval()
    try:
        outputs = _run(model, inputs, info, device)
    finally:
        model.train(was_training)
    if own_loss(outputs) is not None and not loss.whole:  # a user's loss function decides, given the outputs whole
        return DryBatch(inputs, targets, outputs, model_loss(outputs, targets), note)
    if targets is None:
        raise UserError(f"the data's samples {info.inputs} have no targets (a dict sample keeps them under 'labels'), "
                        "and the model returned no loss (outputs.loss); fix: add labels to the samples, or return "
                        "the loss from the model")
    _check_fit(logits_of(outputs), inputs, targets, info, loss)
    _try_loss(loss, outputs, targets)
    return DryBatch(inputs, targets, outputs, loss, note)


def _check_fit(logits, inputs, targets, info: DataInfo, loss: Loss) -> None:
    got = _shape(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
    classes = (loss.ignore_index is not None and isinstance(targets, torch.Tensor) and targets.dim() == 1
               and not targets.is_floating_point())
    if classes and (not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (len(targets), info.num_classes)):
        expected = (len(targets), info.num_classes)
        raise UserError(f"the model maps inputs of {describe(inputs)} to {got}, but the data has "
                        f"{info.num_classes} classes, so it must give {_shape(expected)} (one logit per class); "
                        "build it with num_classes from the data (a model.factory that declares num_classes gets it)")
    if not loss.fits(logits, targets):
        kind = "integer class" if loss.ignore_index is not None else "float"
        fix = "fix the model's output, the targets, or train.loss"
        if loss.ignore_index is not None and isinstance(targets, torch.Tensor) and targets.is_floating_point():
            fix = ("float targets are values, not classes: for a regression set train.loss = mse (or l1; "
                   "bce_with_logits for 0/1 labels), else fix the model's output or the targets")
        raise UserError(f"the model maps inputs of {describe(inputs)} to {got}, but the targets are "
                        f"{describe(targets)}, so train.loss = {loss.name} needs {loss.needs(targets)} with {kind} "
                        f"targets; {fix}")
    if loss.ignore_index is None:
        return
    num_classes = logits.shape[class_dim(logits, targets)]
    counted = targets[targets != IGNORE_INDEX]
    wrong = counted[(counted < 0) | (counted >= num_classes)]
    if len(wrong):
        what = "label" if targets.dim() == 1 else "target"
        raise UserError(f"{what} {int(wrong[0])} in the training data is out of range: {info.name} has "
                        f"{num_classes} classes, so {what}s must be in [0, {num_classes})"
                        + ("" if targets.dim() == 1 else f" (or {IGNORE_INDEX}, not counted)")
                        + "; fix the labels or the data's number of classes")


def _try_loss(loss: Loss, outputs, targets) -> None:
    """The user's loss function once on the dry batch: a broken one is one line now, not a traceback at step 1."""
    if loss.elementwise is not None:
        return
    try:
        with torch.no_grad():
            value = loss(outputs, targets)
    except Exception as e:  # noqa: BLE001 - the user's function
        raise UserError(f"train.loss {loss.name!r}: raised {type(e).__name__}: {str(e).strip()[:160]} on the first "
                        f"batch (outputs {describe(loss.given(outputs))}, targets {describe(targets)}); fix the "
                        "function") from None
    if not (isinstance(value, torch.Tensor) and value.dim() == 0):
        raise UserError(f"train.loss {loss.name!r}: returned {type(value).__name__} "
                        f"{list(getattr(value, 'shape', []))}; fix: return the batch's mean loss as a scalar tensor")


def task_for(dry: DryBatch, specs: tuple[str, ...] = (), functions: tuple[MetricFn, ...] = ()) -> Task:
    """The task's metrics, and the user's (metrics.eval, then fit(metrics=...)), each called once on the dry batch."""
    named = [(spec, import_object("metrics.eval", spec)) for spec in specs]
    named += [(getattr(fn, "__qualname__", repr(fn)), fn) for fn in functions]
    user = tuple(user_metric(spec, fn, dry.outputs, dry.targets) for spec, fn in named)
    return task_of(dry.outputs, dry.targets, dry.loss, user)
