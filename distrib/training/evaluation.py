"""Exact evaluation at any world size: the test set cut into fixed global batches, sums kept as integers (so their
order does not matter), one all-reduce. test_loss always; the task's metrics where they mean something; the user's."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.data import eval_batches, samples
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import unwrap
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError
from distrib.training.losses import (
    IGNORE_INDEX,
    CountedModelLoss,
    Loss,
    class_dim,
    cross_entropy,
    forward,
    logits_of,
    own_loss,
)

_FIXED_POINT = 2.0 ** 32  # losses summed as integers: exact, whatever the order of the sum
TOP_K = 5  # top-5 accuracy is reported when there are more than TOP_K classes
MetricFn = Callable[..., dict]  # (outputs, targets) -> {name: (sum, count)}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass(frozen=True)
class Metric:
    """A user's metric and the names it reports (read from the dry batch, so every rank sums the same entries)."""

    spec: str
    fn: MetricFn
    names: tuple[str, ...]


@dataclass(frozen=True)
class Task:
    """Which metrics mean something, decided once from the dry batch (the same on every rank).
    classes: [B, C] logits of [B] integer targets (top-1, top-5, per class); positions: class logits at each target
    position (token accuracy); sequence: [B, T] class targets (perplexity); values: none of these (regression...)."""

    kind: str = "classes"  # classes | positions | values
    sequence: bool = False
    metrics: tuple[Metric, ...] = ()
    num_classes: int = 0  # classes: the logits' width (top-k accuracy only where there are more than TOP_K)

    def reported(self) -> list[str]:
        """The scalar metrics an evaluation of this task reports (besides test_count), as _metrics reports them."""
        names = ["test_loss"]
        top_k = [f"test_top{TOP_K}_accuracy"] if self.num_classes > TOP_K else []
        names += {"classes": ["test_accuracy", *top_k], "positions": ["test_token_accuracy"],
                  "values": []}[self.kind]
        names += ["test_perplexity"] if self.sequence else []
        return names + [f"test_{name}" for metric in self.metrics for name in metric.names]

    def check_watched(self, key: str, metric: str, validation: bool = False) -> None:
        """Early stopping and best-k must watch a metric this task reports: one line now, not a KeyError later. With
        a validation set, its val_* metrics are reported too (and are what to watch)."""
        reported = self.reported()
        reported += [f"val_{name.removeprefix('test_')}" for name in reported] if validation else []
        if metric and metric.removesuffix("_ema") not in reported:
            hint = "" if validation or not metric.startswith("val_") else (
                " (val_* needs a validation set: data.val_fraction, a factory's (train, val, test) or "
                "fit(val_data=...))")
            raise UserError(f"{key} = {metric!r}: this run reports no {metric.removesuffix('_ema')}{hint} (it reports "
                            f"{', '.join(reported)}); fix: --set {key}={'val' if validation else 'test'}_loss")


def task_of(outputs, targets, loss: Loss, metrics: tuple[Metric, ...] = ()) -> Task:
    logits = logits_of(outputs)
    integer = isinstance(targets, torch.Tensor) and not targets.is_floating_point() and targets.dtype != torch.bool
    sequence = integer and targets.dim() == 2
    if not integer or not isinstance(logits, torch.Tensor) or class_dim(logits, targets) is None:
        return Task("values", sequence, metrics)
    if targets.dim() == 1:
        return Task("classes", False, metrics, num_classes=logits.shape[1])
    # A model that computes its own loss may shift its targets (a causal LM's does): its logits are not aligned with
    # them, whether its loss is trained or a user's loss function decides.
    return Task("values" if loss.name == "model" or own_loss(outputs) is not None else "positions", sequence, metrics)


def user_metric(spec: str, fn: MetricFn, outputs, targets) -> Metric:
    """Calls the metric once on the dry batch: its names, and one line if it breaks the contract."""
    where = f"metrics.eval {spec!r}"
    try:
        result = fn(logits_of(outputs), targets)
    except Exception as e:  # noqa: BLE001 - the user's function
        raise UserError(f"{where}: raised {type(e).__name__}: {str(e).strip()[:160]} on the first batch; fix the "
                        "metric") from None
    if not (isinstance(result, dict) and result and all(isinstance(k, str) and k.isidentifier()
                                                        and isinstance(v, (tuple, list)) and len(v) == 2
                                                        for k, v in result.items())):
        raise UserError(f"{where}: returned {type(result).__name__} {str(result)[:80]}; fix: return "
                        "{name: (sum, count)}, e.g. {\"mae\": (errors.abs().sum(), errors.numel())}")
    return Metric(spec, fn, tuple(sorted(result)))


def _fixed(value) -> torch.Tensor:
    return (torch.as_tensor(value).double() * _FIXED_POINT).round().long()


def _loss_sum(loss: Loss, outputs, targets, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss in fixed point, what it counts): per counted position for the built-ins, else the batch mean x
    its samples (each sample sits in the same fixed batch at any world size, so the mean is the same bits)."""
    logits = logits_of(outputs)
    if loss.elementwise is not None and loss.fits(logits, targets):
        return _fixed(loss.elementwise(logits.float(), targets)).sum(), loss.count(targets)
    if isinstance(loss, CountedModelLoss):  # a mean over counted positions: their sum, and how many
        count = loss.count(targets)
        return _fixed(loss(outputs, targets).float() * count), count
    own = own_loss(outputs) if loss.name == "model" else None
    mean = own if own is not None else loss(outputs, targets)
    return _fixed(mean.float() * num_samples), torch.tensor(num_samples)


def _batch_stats(inputs, outputs, targets, loss: Loss, num_classes: int, task: Task, device) -> torch.Tensor:
    """[loss sum, loss count, samples, top-1, top-k, tokens right, tokens counted, right per class..., seen per
    class..., (sum, count) per user metric...] as int64. The samples are counted in the targets (or the inputs), never
    in the outputs, whatever their structure."""
    logits = logits_of(outputs)
    num_samples = samples.num_samples(targets, inputs)
    head = [*_loss_sum(loss, outputs, targets, num_samples), torch.tensor(num_samples)]
    per_class = torch.zeros(2, num_classes if task.kind == "classes" else 0, dtype=torch.int64, device=device)
    counts = [torch.tensor(0)] * 4
    if task.kind == "classes":
        top1 = logits.argmax(dim=1) == targets
        k = min(TOP_K, logits.shape[1])
        counts[:2] = top1.sum(), (logits.topk(k, dim=1).indices == targets[:, None]).any(dim=1).sum()
        per_class[0].index_add_(0, targets, top1.long())
        per_class[1].index_add_(0, targets, torch.ones_like(targets))
    elif task.kind == "positions":
        counted = targets != IGNORE_INDEX
        right = logits.argmax(dim=class_dim(logits, targets)) == targets
        counts[2:] = (right & counted).sum(), counted.sum()
    user = []
    for metric in task.metrics:
        result = metric.fn(logits, targets)
        if tuple(sorted(result)) != metric.names:
            raise UserError(f"metrics.eval {metric.spec!r}: returned {sorted(result)} on a test batch and "
                            f"{list(metric.names)} on the first one; fix: return the same names for every batch")
        user += [item for name in metric.names for item in (_fixed(result[name][0]), torch.as_tensor(result[name][1]))]
    scalars = torch.stack([torch.as_tensor(v).long().to(device) for v in head + counts[:2] + counts[2:] + user])
    return torch.cat([scalars[:7], per_class.reshape(-1), scalars[7:]])


def evaluate(model: nn.Module, source, num_classes: int, batch_size: int, runtime: Runtime, loss: Loss | None = None,
             precision: str = "fp32", class_names: tuple[str, ...] = (), task: Task = Task(),
             dims: ParallelDims | None = None) -> dict:
    """Exact metrics over the whole test set: every sample counted once, one all-reduce. Runs the unwrapped
    module, so no DDP hooks fire; every rank makes as many forward calls as the busiest (an FSDP module all-gathers in
    every forward), the extra ones not counted."""
    model, loss = unwrap(model), loss or cross_entropy()
    classes = num_classes if task.kind == "classes" else 0
    stats = torch.zeros(7 + 2 * classes + 2 * sum(len(m.names) for m in task.metrics), dtype=torch.int64,
                        device=runtime.device)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    dims = dims or ParallelDims.replicas(runtime.world_size)  # the batch mesh: a tensor-parallel group reads alike
    batches = eval_batches(source.num_samples, batch_size, dims.batch_rank(runtime.rank), dims.data_parallel)
    num_counted = len(batches)
    # Every rank makes as many forward calls as the busiest (one-sample batches, not counted): a sharded model's
    # forward is a collective. Under ddp the unwrapped module makes none, and the few extra samples cost nothing.
    busiest = max(len(eval_batches(source.num_samples, batch_size, r, dims.data_parallel))
                  for r in range(dims.data_parallel))
    batches = batches + [torch.arange(1)] * (busiest - num_counted)
    with torch.no_grad(), autocast(precision, runtime.device):
        for batch_index, (inputs, targets) in enumerate(source.batches(batches)):
            outputs = forward(model, inputs)
            if batch_index < num_counted:
                stats += _batch_stats(inputs, outputs, targets, loss, classes, task, runtime.device)
    for module, training in modes:  # each module's own mode back, not model.train(), which would recurse: a layer
        module.training = training  # that a callback put in eval mode (frozen BatchNorm) stays in it
    dist.all_reduce(stats)
    stats //= dims.world_size // dims.data_parallel  # a tensor-parallel group, a pipeline: their ranks counted alike
    return _metrics(stats.tolist(), classes, class_names, task)


def _metrics(stats: list[int], num_classes: int, class_names: tuple[str, ...], task: Task) -> dict:
    loss_sum, loss_count, count, correct, correct_k, tokens_right, tokens, *rest = stats
    metrics = {"test_loss": loss_sum / _FIXED_POINT / max(loss_count, 1)}
    if task.kind == "classes":
        metrics["test_accuracy"] = correct / count
    metrics["test_count"] = count
    if task.kind == "classes":
        if num_classes > TOP_K:
            metrics[f"test_top{TOP_K}_accuracy"] = correct_k / count
        names = class_names or tuple(str(c) for c in range(num_classes))
        right, seen = rest[:num_classes], rest[num_classes:2 * num_classes]
        metrics["test_per_class_accuracy"] = {name: (r / s if s else None) for name, r, s in zip(names, right, seen)}
    if task.kind == "positions":
        metrics["test_token_accuracy"] = tokens_right / max(tokens, 1)
        metrics["test_token_count"] = tokens
    if task.sequence:
        metrics["test_perplexity"] = math.exp(min(metrics["test_loss"], 700.0))  # exp(710) overflows a float
    user = rest[2 * num_classes:]
    names = [name for metric in task.metrics for name in metric.names]
    for index, name in enumerate(names):
        total, seen = user[2 * index], user[2 * index + 1]
        metrics[f"test_{name}"] = total / _FIXED_POINT / seen if seen else None
    return metrics
