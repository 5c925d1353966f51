"""Exact evaluation at any world size: the test set cut into fixed global batches, sums kept as integers (so their
order does not matter), one all-reduce; test loss of the training loss, top-1, top-5 and per-class accuracy."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.data import eval_batches
from distrib.distributed.parallel import is_sharded, unwrap
from distrib.distributed.runtime import Runtime
from distrib.training.losses import Loss, cross_entropy

_FIXED_POINT = 2.0 ** 32  # losses summed as integers: exact, whatever the order of the sum
TOP_K = 5  # top-5 accuracy is reported when there are more than TOP_K classes


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def _loss_sum(loss: Loss, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The batch's summed loss in fixed point: per sample where the loss has that form, else mean x count (each sample
    sits in the same fixed batch at any world size, so the batch mean is the same bits everywhere)."""
    if loss.per_sample is not None:
        return (loss.per_sample(logits, targets).double() * _FIXED_POINT).round().long().sum()
    return (loss(logits, targets).double() * len(targets) * _FIXED_POINT).round().long()


def _batch_stats(logits: torch.Tensor, targets: torch.Tensor, loss: Loss, num_classes: int) -> torch.Tensor:
    """[loss sum, top-1 correct, top-k correct, count, correct per class..., count per class...] as int64."""
    top1 = logits.argmax(dim=1) == targets
    k = min(TOP_K, logits.shape[1])
    topk = (logits.topk(k, dim=1).indices == targets[:, None]).any(dim=1)
    per_class = torch.zeros(2, num_classes, dtype=torch.int64, device=logits.device)
    per_class[0].index_add_(0, targets, top1.long())
    per_class[1].index_add_(0, targets, torch.ones_like(targets))
    head = torch.stack([_loss_sum(loss, logits, targets), top1.sum(), topk.sum(),
                        torch.tensor(len(targets), device=logits.device)])
    return torch.cat([head, per_class.reshape(-1)])


def evaluate(model: nn.Module, source, num_classes: int, batch_size: int, runtime: Runtime, loss: Loss | None = None,
             precision: str = "fp32", class_names: tuple[str, ...] = ()) -> dict:
    """Exact metrics over the whole test set: every sample once, no padding, one all-reduce. Runs the unwrapped
    module, so no DDP hooks fire and ranks may see different numbers of batches (an FSDP module all-gathers in every
    forward, so there each rank makes as many forward calls as the busiest, the extra ones not counted). Keys:
    test_loss, test_accuracy (top-1), test_top5_accuracy (more than 5 classes only), test_count,
    test_per_class_accuracy {name: accuracy}."""
    model, loss = unwrap(model), loss or cross_entropy()
    stats = torch.zeros(4 + 2 * num_classes, dtype=torch.int64, device=runtime.device)
    was_training = model.training
    model.eval()
    batches = eval_batches(source.num_samples, batch_size, runtime.rank, runtime.world_size)
    num_counted = len(batches)
    if is_sharded(model):  # pad with one-sample batches
        busiest = max(len(eval_batches(source.num_samples, batch_size, r, runtime.world_size))
                      for r in range(runtime.world_size))
        batches = batches + [torch.arange(1)] * (busiest - num_counted)
    with torch.no_grad(), autocast(precision, runtime.device):
        for batch_index, (inputs, targets) in enumerate(source.batches(batches)):
            logits = model(inputs).float()
            if batch_index < num_counted:
                stats += _batch_stats(logits, targets, loss, num_classes)
    model.train(was_training)
    dist.all_reduce(stats)
    loss_sum, correct, correct_k, count, *per_class = stats.tolist()
    names = class_names or tuple(str(c) for c in range(num_classes))
    metrics = {"test_loss": loss_sum / _FIXED_POINT / count, "test_accuracy": correct / count, "test_count": count}
    if num_classes > TOP_K:
        metrics[f"test_top{TOP_K}_accuracy"] = correct_k / count
    right, seen = per_class[:num_classes], per_class[num_classes:]
    metrics["test_per_class_accuracy"] = {name: (r / s if s else None) for name, r, s in zip(names, right, seen)}
    return metrics
