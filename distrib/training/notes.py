"""The log lines a run opens with about its task: where the loss comes from, which metrics it reports, how it steps
(optimizer, schedule, warm-up), and what would keep runs at other world sizes from agreeing (dropout) or the schedule
from reaching train.lr (a long warm-up)."""

from __future__ import annotations

import torch.nn as nn

from distrib.config import TrainConfig
from distrib.torch_private import DropoutBase
from distrib.training.evaluation import Task
from distrib.training.losses import Loss


def dropout_layers(model: nn.Module) -> list[str]:
    """Names of the layers that draw random masks in training (dropout with p > 0, attention dropout too)."""
    found = []
    for name, module in model.named_modules():
        p = getattr(module, "p", None) if isinstance(module, DropoutBase) else None
        if p is None and isinstance(module, nn.MultiheadAttention):
            p = module.dropout
        if p:
            found.append(name or type(module).__name__)
    return found


def optimizer_note(config: TrainConfig, total_steps: int | None) -> str:
    """How the run steps, in one line: the defaults (sgd, momentum 0.9, cosine, 100 warm-up steps) are not what a
    script being ported may have used, and each takes an override to change."""
    builtin = {"sgd": [f"momentum {config.momentum:g}"], "adam": [f"betas {config.betas[0]:g}, {config.betas[1]:g}"]}
    builtin["adamw"] = builtin["adam"]
    settings = builtin.get(config.optimizer, ["your function: its learning rate is the peak"])
    if config.weight_decay:
        settings.append(f"weight decay {config.weight_decay:g}")
    lr = f"lr {config.lr:g}, " if config.optimizer in builtin else ""
    warmup = f"after {config.warmup_steps} warm-up steps" if config.warmup_steps else "without warm-up"
    length = config.schedule_steps or total_steps  # as build_scheduler spans it; None: a stream's, unknown
    schedule = (f"constant {warmup}" if config.schedule == "constant"
                else f"cosine to 0 over {max(0, length - config.warmup_steps)} steps {warmup}" if length
                else f"cosine to 0 at the end {warmup}")
    clip = f", gradient norm clipped at {config.grad_clip:g}" if config.grad_clip else ""
    return f"optimizer {config.optimizer} ({', '.join(settings)}), {lr}{schedule}{clip}"


def task_notes(config: TrainConfig, loss: Loss, task: Task, model: nn.Module, total_steps: int | None
               ) -> list[str]:
    source = ("the model's own outputs.loss (train.loss is not used)" if loss.name == "model"
              else f"train.loss = {loss.name}")
    if getattr(loss, "shift", None) is not None:  # a CountedModelLoss
        source += (", a mean over the labels' counted positions" + (" shifted by one" if loss.shift else "")
                   + ": each step divides by the global batch's count")
    notes = [f"loss: {source}; metrics: {', '.join(task.reported())}", optimizer_note(config, total_steps)]
    dropout = dropout_layers(model)
    if dropout:
        notes.append(f"the model has {len(dropout)} dropout layers ({dropout[0]}, ...): their random masks differ "
                     "between world sizes and grad_accum_steps (each micro-batch draws its own), so such runs no "
                     "longer agree exactly; set their p to 0 to compare runs")
    if total_steps is not None and config.warmup_steps > total_steps:  # None: a stream's, unknown
        notes.append(f"train.warmup_steps = {config.warmup_steps} is longer than this run's {total_steps} steps: the "
                     f"learning rate never reaches train.lr = {config.lr:g} (it ends at "
                     f"{config.lr * total_steps / config.warmup_steps:.3g}); set train.warmup_steps below "
                     f"{total_steps}")
    return notes
