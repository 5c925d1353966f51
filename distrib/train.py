"""The training loop: optimizer and schedule, one optimizer step over micro-batches, exact evaluation, and fit.

Every rank makes the same collectives in the same order: DDP's bucketed all-reduce in the last micro-step's backward,
one small all-reduce of (loss, stop votes) on log steps and every train.sync_every steps, one all-reduce of
(loss, correct, count) per evaluation."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distrib.config import TrainConfig
from distrib.data import BatchPlan, epoch_steps, eval_batches
from distrib.errors import ConfigError, UserError
from distrib.metrics import Recorder
from distrib.parallel import check_batch, explain_device_errors, grad_sync, unwrap
from distrib.preempt import Preempted, StopFlag
from distrib.runtime import Runtime
from distrib.throughput import Throughput, count_flops_per_sample

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
    """The schedule spans train.schedule_steps when set (so a run extended later continues the same curve), else
    this run's total_steps (an extended run then recomputes it: the cosine jumps back up)."""
    length = config.schedule_steps or total_steps
    if config.schedule == "cosine" and length < total_steps:
        raise ConfigError(f"train.schedule_steps = {config.schedule_steps}: shorter than this run's {total_steps} "
                          f"steps, so the learning rate would be 0 after step {length}; set it to {total_steps} or "
                          "more, or to 0 (the run's length)")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, length, config))


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
    steps_this_run: int = 0
    checkpointer: object = None  # a distrib.checkpoint.Checkpointer, or None: no checkpoints
    stop: StopFlag = field(default_factory=StopFlag)  # set by a signal handler; agreed on in step()
    stop_agreed: bool = False
    meter: Throughput = None  # step times, data wait and MFU; see distrib.throughput
    nonfinite: torch.Tensor = None  # accelerators: a device-side flag, set by any finite check since the last sync
    synced_at: int = 0  # the last sync step

    def __post_init__(self):
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(self.runtime.device.type, enabled=self.config.precision == "fp16")
        if self.meter is None:
            self.meter = Throughput(self.plan.global_batch_size, self.runtime.world_size)

    def step(self, micro_batches) -> torch.Tensor:
        """One optimizer step; returns the loss averaged over the global batch (the same on every rank) on sync steps
        (log steps among them), and this rank's share of it on the others."""
        device, n = self.runtime.device, len(micro_batches)
        local = None  # this rank's loss; summed without a zeros() and an add when there is one micro-batch
        if self.steps_this_run == 0:
            check_batch({"inputs": micro_batches[0][0], "targets": micro_batches[0][1]}, device)
            self.meter.flops_per_sample = count_flops_per_sample(unwrap(self.model), *micro_batches[0])
        for i, (inputs, targets) in enumerate(micro_batches):
            # Sync off for the whole forward+backward of non-final micro-steps: DDP decides in the forward.
            with grad_sync(self.model, i == n - 1), \
                    explain_device_errors(self.model, device, {"inputs": inputs, "targets": targets}):
                with autocast(self.config.precision, device):
                    loss = F.cross_entropy(self.model(inputs), targets)
                    loss = loss / n if n > 1 else loss  # x / 1 is x, bit for bit: skip its kernel and graph node
                self.scaler.scale(loss).backward()
            local = loss.detach() if local is None else local + loss.detach()
        step = self.progress.step + 1
        self._check_finite(local, step)
        loss = self._agree(local, step) if self.is_sync_step(step) else local
        if self.config.grad_clip:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss

    def is_log_step(self, step: int) -> bool:
        return step % self.config.log_every == 0 or step == self.total_steps

    def is_sync_step(self, step: int) -> bool:
        # Checkpoint steps too: the finite flag is read there, so no checkpoint holds weights that went NaN.
        return (step % self.config.sync_every == 0 or self.is_log_step(step)
                or (self.checkpointer is not None and self.checkpointer.due(step)))

    def _agree(self, local: torch.Tensor, step: int) -> torch.Tensor:
        """One small all-reduce carries the loss, the stop votes and (on accelerators) the finite flag: SUM, then
        divide for the global mean of equal-sized micro-batches; any rank's signal stops every rank at this same step
        boundary. Only on sync steps: per step, its latency and host sync cost 7-13% of a small model's step on a
        shared CPU (bench)."""
        flag = self.nonfinite if self.nonfinite is not None else torch.zeros((), device=local.device)
        reduced = torch.stack([local, torch.full((), float(self.stop.requested), device=local.device),
                               flag.to(local.dtype)])
        dist.all_reduce(reduced)
        stop, nonfinite = reduced[1:].tolist()  # the host sync, on sync steps only
        self.stop_agreed = stop > 0
        if nonfinite > 0:
            first = self.synced_at + 1  # the flag covers the checks since the last sync step
            where = f"at step {step}" if first >= step else f"between steps {first} and {step}"
            self._diverged(where, reduced[0] / self.runtime.world_size)
        self.nonfinite, self.synced_at = None, step
        return reduced[0] / self.runtime.world_size

    def _check_finite(self, local: torch.Tensor, step: int) -> None:
        # Reads the gradients after DDP's all-reduce: the same on every rank, so all ranks decide alike and stop
        # together, with no collective of its own. fp16 skips such steps in its GradScaler instead.
        every = self.config.finite_check_every
        if self.config.precision == "fp16" or not every or step % every:
            return
        # The optimizer's list, not model.parameters() (a walk of the module tree), and _foreach_norm (one fused kernel
        # per device and dtype on accelerators).
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        norms = torch._foreach_norm(grads)
        if self.runtime.host_sync_is_free:
            # The CPU reads it now, before the optimizer writes NaN into the weights; summing in Python skips
            # stack/isfinite/all, which cost three times the norms themselves (bench: 1-2% of a small CPU step).
            if not math.isfinite(sum(norm.item() for norm in norms)):
                self._diverged(f"at step {step}", local)
        else:
            # Accelerators keep a flag on the device and read it on the next sync step (checkpoint steps among them),
            # in the all-reduce that goes then anyway: no host sync of its own, which would stall the queue each step.
            bad = ~torch.stack(norms).isfinite().all()
            self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad

    def _diverged(self, where: str, loss: torch.Tensor):
        raise UserError(f"train gradients are not finite {where} (loss {loss.item():.4g}): training diverged; "
                        f"lower train.lr (now {self.config.lr}), set train.grad_clip=1.0, or use more warm-up")

    def _maybe_checkpoint(self, step: int) -> None:
        """After the step's time is taken: the save is not step time (the meter's clock restarts after it)."""
        if self.stop_agreed:
            path = self.checkpointer.save(step) if self.checkpointer else None
            raise Preempted(step, path)
        if self.checkpointer and self.checkpointer.due(step):
            self.checkpointer.save(step)
            self.meter.restart_clock()

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
        step_in_epoch = saved["samples_in_epoch"] // self.plan.global_batch_size
        self.progress = Progress(saved["step"], saved["epoch"], step_in_epoch)

    def evaluate(self, source, num_samples: int, batch_size: int) -> dict:
        return evaluate(self.model, source, num_samples, batch_size, self.runtime, self.config.precision)

    def fit(self, train_source, test_source, num_test: int, eval_batch_size: int) -> dict:
        """Trains from self.progress to total_steps; evaluates each eval_every_epochs and at the end."""
        p, cfg, rec = self.progress, self.config, self.recorder
        bar = rec.progress_bar(self.total_steps, initial=p.step)
        self.synced_at = p.step
        self.meter.restart_clock()
        while p.step < self.total_steps:
            for micro_batches in epoch_steps(train_source, self.plan, p.epoch, p.step_in_epoch):
                self.meter.data_ready()  # the time since the previous step ended was spent getting this batch
                loss = self.step(micro_batches)
                p.step, p.step_in_epoch = p.step + 1, p.step_in_epoch + 1
                self.steps_this_run += 1
                bar.update(1)
                if self.is_log_step(p.step):
                    loss_value = loss.item()  # host sync: only on log steps, so the step times are honest here
                    self.meter.step_done()
                    rec.log_step(p.step, p.epoch, loss_value, self.scheduler.get_last_lr()[0], **self.meter.window())
                else:
                    self.meter.step_done()
                self._maybe_checkpoint(p.step)
                if p.step == self.total_steps:
                    break
            if p.step_in_epoch == self.plan.steps_per_epoch:
                p.epoch, p.step_in_epoch = p.epoch + 1, 0
                if cfg.eval_every_epochs and p.epoch % cfg.eval_every_epochs == 0 and p.step < self.total_steps:
                    rec.log_eval(p.step, p.epoch, self.evaluate(test_source, num_test, eval_batch_size))
                    self.meter.restart_clock()  # keep evaluation out of the step times
        bar.close()
        if self.checkpointer and not self.checkpointer.due(p.step):
            self.checkpointer.save(p.step)  # the final state, so that a later run can extend this one
        metrics = self.evaluate(test_source, num_test, eval_batch_size)
        rec.log_eval(p.step, p.epoch, metrics)
        return {**metrics, "train_loss": rec.last_loss}
