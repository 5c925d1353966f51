"""Before step 1: one dry batch of the training data through the placed model, so that a model that does not fit the
data fails with one line naming both shapes (not a 70-line traceback or `Target 8 is out of bounds` at step 1)."""

from __future__ import annotations

import torch
import torch.nn as nn

from distrib.data import DataInfo
from distrib.distributed.parallel import check_batch, explain_device_errors, unwrap
from distrib.errors import UserError

DRY_BATCH_SIZE = 2


def _shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _run(model: nn.Module, inputs: torch.Tensor, info: DataInfo, device: torch.device):
    batch = {"inputs": inputs}
    try:
        with torch.no_grad(), explain_device_errors(model, device, batch):
            return model(inputs)
    except (RuntimeError, ValueError, TypeError) as e:  # the shape errors of conv and linear layers, mostly
        said = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"the model cannot take the data's inputs: on a batch of shape {_shape(inputs.shape)} "
                        f"({info.name}, {info.num_classes} classes) it raised {type(e).__name__}: {said}; make the "
                        f"model take {_shape(info.input_shape)} inputs (a model.factory that declares in_channels "
                        "and image_size gets them from the data)") from e


def dry_batch(model: nn.Module, source, info: DataInfo, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the plain placed model on the first samples of `source` in eval mode without gradients (no dropout draws,
    no BatchNorm statistics, no RNG: the training that follows is bitwise what it would be without this), checks
    that it maps them to [batch, num_classes] and that their labels are in range; returns the batch."""
    indices = torch.arange(min(DRY_BATCH_SIZE, source.num_samples))
    inputs, targets = next(iter(source.batches([indices])))
    check_batch({"inputs": inputs, "targets": targets}, device)
    model = unwrap(model)
    was_training = model.training
    model.eval()
    try:
        outputs = _run(model, inputs, info, device)
    finally:
        model.train(was_training)
    expected = (len(inputs), info.num_classes)
    if not isinstance(outputs, torch.Tensor) or tuple(outputs.shape) != expected:
        got = _shape(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
        raise UserError(f"the model maps inputs of shape {_shape(inputs.shape)} to {got}, but the data has "
                        f"{info.num_classes} classes, so it must give {_shape(expected)} (one logit per class); "
                        "build it with num_classes from the data (a model.factory that declares num_classes gets it)")
    wrong = targets[(targets < 0) | (targets >= info.num_classes)]
    if len(wrong):
        raise UserError(f"label {int(wrong[0])} in the training data is out of range: {info.name} has "
                        f"{info.num_classes} classes, so labels must be in [0, {info.num_classes}); fix the labels "
                        "or the data's number of classes")
    return inputs, targets
