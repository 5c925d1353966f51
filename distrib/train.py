"""The training loop: optimizer and schedule, one optimizer step over micro-batches, exact evaluation, and fit.

Every rank makes the same collectives in the same order: DDP's bucketed all-reduce in the last micro-step's backward,
one all-reduce of the loss per step, one all-reduce of (loss, correct, count) per evaluation."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distrib.config import TrainConfig
from distrib.data import BatchPlan, eval_batches, epoch_steps
from distrib.errors import UserError
from distrib.metrics import Recorder
from distrib.parallel import check_batch, explain_device_errors, grad_sync, unwrap
from distrib.preempt import Preempted, StopFlag
from distrib.runtime import Runtime

_FIXED_POINT = 2.0 ** 32  # per-sample losses summed as integers: exact, whatever the order of the sum


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    params = model.parameters()
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=config.lr, weight_decay=config.weight_decay)


def lr_factor(step: int, total_steps: int, config: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then constant or cosine decay to zero at total_steps."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer, total_steps: int, config: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def evaluate(model: nn.Module, source, num_samples: int, batch_size: int, runtime: Runtime,
             precision: str = "fp32") -> dict:
    """Exact metrics over the whole test set: every sample once, no padding, one all-reduce.
    Runs the unwrapped module, so no DDP hooks fire and ranks may see different numbers of batches."""
    model = unwrap(model)
    stats = torch.zeros(3, dtype=torch.int64, device=runtime.device)  # loss (fixed point), correct, count
    model.eval()
    with torch.no_grad(), autocast(precision, runtime.device):
        for inputs, targets in source.batches(eval_batches(num_samples, batch_size, runtime.rank, runtime.world_size)):
            logits = model(inputs).float()
            losses = F.cross_entropy(logits, targets, reduction="none").double()
            stats[0] += (losses * _FIXED_POINT).round().long().sum()
            stats[1] += (logits.argmax(dim=1) == targets).sum()
            stats[2] += targets.numel()
    model.train()
    dist.all_reduce(stats)
    loss_sum, correct, count = stats.tolist()
    return {"test_loss": loss_sum / _FIXED_POINT / count, "test_accuracy": correct / count, "test_count": count}


@dataclass
class Progress:
    """Where training stands; enough, with the seed, to continue the data order exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in `epoch`


@dataclass
class Trainer:
    model: nn.Module  # the DDP-wrapped model
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    config: TrainConfig
    runtime: Runtime
    plan: BatchPlan
    total_steps: int
    recorder: Recorder
    scaler: torch.amp.GradScaler = None
    progress: Progress = field(default_factory=Progress)
    train_seconds: float = 0.0  # wall time of this run's optimizer steps, evaluation excluded
    steps_this_run: int = 0
    checkpointer: object = None  # a distrib.checkpoint.Checkpointer, or None: no checkpoints
    stop: StopFlag = field(default_factory=StopFlag)  # set by a signal handler; agreed on in step()
    stop_agreed: bool = False

    def __post_init__(self):
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.runtime.device.type, enabled=self.config.precision == "fp16")

    @property
    def samples_per_second(self) -> float:
        return self.steps_this_run * self.plan.global_batch_size / max(self.train_seconds, 1e-9)

    def step(self, micro_batches) -> torch.Tensor:
        """One optimizer step; returns the loss averaged over the global batch (same value on every rank)."""
        device, n = self.runtime.device, len(micro_batches)
        local = torch.zeros((), device=device)
        if self.steps_this_run == 0:
            check_batch({"inputs": micro_batches[0][0], "targets": micro_batches[0][1]}, device)
        for i, (inputs, targets) in enumerate(micro_batches):
            # Sync off for the whole forward+backward of non-final micro-steps: DDP decides in the forward.
            with grad_sync(self.model, i == n - 1), \
                    explain_device_errors(self.model, device, {"inputs": inputs, "targets": targets}):
                with autocast(self.config.precision, device):
                    loss = F.cross_entropy(self.model(inputs), targets) / n
                self.scaler.scale(loss).backward()
            local += loss.detach()
        # One all-reduce per step carries the loss and the stop votes: SUM, then divide for the global mean of
        # equal-sized micro-batches; any rank's signal stops every rank at this same step boundary.
        reduced = torch.stack([local, torch.full((), float(self.stop.requested), device=device)])
        dist.all_reduce(reduced)
        loss = reduced[0] / self.runtime.world_size
        loss_sum, votes = reduced.tolist()  # the one host sync per step: finite check and stop votes
        self._check_finite(loss_sum / self.runtime.world_size)
        self.stop_agreed = votes > 0
        if self.config.grad_clip:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss

    def _check_finite(self, loss: float) -> None:
        # The reduced loss is the same on every rank, so all ranks stop together, before the weights turn NaN.
        # fp16 skips such steps in its GradScaler instead.
        if self.config.precision != "fp16" and not math.isfinite(loss):
            raise UserError(f"train loss is {loss} at step {self.progress.step + 1}: training diverged; "
                            f"lower train.lr (now {self.config.lr}), set train.grad_clip=1.0, or use more warm-up")

    def _maybe_checkpoint(self, step: int) -> None:
        if self.stop_agreed:
            path = self.checkpointer.save(step) if self.checkpointer else None
            raise Preempted(step, path)
        if self.checkpointer and self.checkpointer.due(step):
            self.checkpointer.save(step)

    def state_dict(self) -> dict:
        """Everything but the RNGs (gathered from every rank by the Checkpointer); no module. prefixes."""
        p = self.progress
        return {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "progress": {"step": p.step, "epoch": p.epoch, "step_in_epoch": p.step_in_epoch,
                             "samples_in_epoch": p.step_in_epoch * self.plan.global_batch_size}}

    def load_state_dict(self, state: dict) -> None:
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        saved = state["progress"]
        # Position in the epoch by samples, so a changed global batch (forced) lands on the right sample.
        self.progress = Progress(saved["step"], saved["epoch"], saved["samples_in_epoch"] // self.plan.global_batch_size)

    def evaluate(self, source, num_samples: int, batch_size: int) -> dict:
        return evaluate(self.model, source, num_samples, batch_size, self.runtime, self.config.precision)

    def fit(self, train_source, test_source, num_test: int, eval_batch_size: int) -> dict:
        """Trains from self.progress to total_steps; evaluates each eval_every_epochs and at the end."""
        p, cfg, rec = self.progress, self.config, self.recorder
        bar = rec.progress_bar(self.total_steps, initial=p.step)
        window_start, window_steps = time.perf_counter(), 0
        fit_start, eval_seconds = window_start, 0.0
        while p.step < self.total_steps:
            for micro_batches in epoch_steps(train_source, self.plan, p.epoch, p.step_in_epoch):
                loss = self.step(micro_batches)
                p.step, p.step_in_epoch, window_steps = p.step + 1, p.step_in_epoch + 1, window_steps + 1
                self.steps_this_run += 1
                bar.update(1)
                self._maybe_checkpoint(p.step)
                if p.step % cfg.log_every == 0 or p.step == self.total_steps:
                    loss_value = loss.item()  # host sync: only on log steps, so the clock below is honest
                    elapsed = time.perf_counter() - window_start
                    rec.log_step(p.step, p.epoch, loss_value, self.scheduler.get_last_lr()[0],
                                 window_steps * self.plan.global_batch_size / max(elapsed, 1e-9))
                    window_start, window_steps = time.perf_counter(), 0
                if p.step == self.total_steps:
                    break
            if p.step_in_epoch == self.plan.steps_per_epoch:
                p.epoch, p.step_in_epoch = p.epoch + 1, 0
                if cfg.eval_every_epochs and p.epoch % cfg.eval_every_epochs == 0 and p.step < self.total_steps:
                    eval_start = time.perf_counter()
                    rec.log_eval(p.step, p.epoch, self.evaluate(test_source, num_test, eval_batch_size))
                    eval_seconds += time.perf_counter() - eval_start
                    window_start += time.perf_counter() - eval_start  # keep evaluation out of samples/s
        bar.close()
        self.runtime.synchronize()
        self.train_seconds = time.perf_counter() - fit_start - eval_seconds
        if self.checkpointer and not self.checkpointer.due(p.step):
            self.checkpointer.save(p.step)  # the final state, so that a later run can extend this one
        metrics = self.evaluate(test_source, num_test, eval_batch_size)
        rec.log_eval(p.step, p.epoch, metrics)
        return {**metrics, "train_loss": rec.last_loss}
