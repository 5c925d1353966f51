"""The training loop: optimizer and schedule, the state a checkpoint restores, one optimizer step over micro-batches,
and fit.

Every rank makes the same collectives in the same order: DDP's bucketed all-reduce in the last micro-step's backward,
one small all-reduce of (loss, extra losses, stop votes, finite flag) on sync steps (distrib.agreement), one
all-reduce of the integer sums per evaluation (distrib.evaluation)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from distrib.checkpoint import BestCheckpoints, Checkpointer
from distrib.config import TrainConfig
from distrib.data import Batch, BatchPlan, epoch_steps
from distrib.data.samples import named
from distrib.distributed.across import AgreementLost, StepAcross
from distrib.distributed.agreement import RankAgreement
from distrib.distributed.parallel import local_tensor, unwrap
from distrib.distributed.strategies import DDPStrategy, StepLoss, Strategy
from distrib.errors import ConfigError, UserError
from distrib.launch.preempt import Preempted
from distrib.metrics import Recorder
from distrib.training.callbacks import Callbacks
from distrib.training.early_stop import EarlyStopping
from distrib.training.ema import EMA
from distrib.training.evaluation import autocast, evaluate
from distrib.training.experts import ExpertLoad
from distrib.training.extra_losses import ExtraLosses
from distrib.training.losses import Loss, forward, step_loss
from distrib.training.optimizers import chunked_steps, param_groups, user_optimizer
from distrib.training.throughput import Throughput

__all__ = ["Progress", "TrainState", "Trainer", "autocast", "build_optimizer", "build_scheduler", "evaluate",
           "lr_factor", "new_state"]


def build_optimizer(model: nn.Module, config: TrainConfig, log: Callable[[str], None] | None = None
                    ) -> torch.optim.Optimizer:
    """train.optimizer over the model's parameters; adam and adamw in two groups when weight decay is on, so that
    biases, norms and embeddings are not decayed (train.decay = weights); a user's function gets those groups."""
    # foreach: one op over all parameters, PyTorch's default on GPUs, here on CPUs too, where its loop over parameters
    # (bitwise the same) pays a dispatch per op and parameter: AdamW on the bench GPT 34 -> 10 ms a step under fsdp.
    # In chunks (optimizers.chunked_steps), so that its temporaries are not the size of the whole local model.
    if config.optimizer == "sgd":
        trainable = [param for param in model.parameters() if param.requires_grad]  # frozen ones get no state
        return chunked_steps(torch.optim.SGD)(trainable, lr=config.lr, momentum=config.momentum,
                                              weight_decay=config.weight_decay, foreach=True)
    groups = param_groups(model, config, log or (lambda message: None))
    if config.optimizer in ("adam", "adamw"):
        cls = chunked_steps(torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW)
        return cls(groups, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay, foreach=True)
    return user_optimizer(config, groups)


def lr_factor(step: int, total_steps: int, config: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then constant or cosine decay to zero at total_steps."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_scheduler(optimizer, total_steps: int | None, config: TrainConfig):
    """The schedule spans train.schedule_steps when set (so a run extended later continues the same curve), else
    this run's total_steps (an extended run then recomputes it: the cosine jumps back up). total_steps None: a stream
    trained by passes, whose schedule needs no length (constant) or has train.schedule_steps (distrib.worker)."""
    length = config.schedule_steps or total_steps or 0
    if config.schedule == "cosine" and total_steps is not None and length < total_steps:
        raise ConfigError(f"train.schedule_steps = {config.schedule_steps}: shorter than this run's {total_steps} "
                          f"steps, so the learning rate would be 0 after step {length}; set it to {total_steps} or "
                          "more, or to 0 (the run's length)")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, length, config))


@dataclass
class Progress:
    """Where training stands; enough, with the seed, to continue the data order exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in `epoch`


@dataclass
class TrainState:
    """What a checkpoint restores: the model (DDP-wrapped), optimizer, LR schedule, grad scaler, and progress; and
    where asked, the EMA weights, the early-stopping count, the best-k set, and the tracker runs to continue."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    progress: Progress = field(default_factory=Progress)
    ema: EMA | None = None  # train.ema_decay > 0 (distrib.ema)
    early_stop: EarlyStopping | None = None  # train.early_stop_metric set (distrib.early_stop)
    best: BestCheckpoints | None = None  # checkpoint.keep_best > 0 (distrib.best)
    tracker_ids: dict = field(default_factory=dict)  # logger name -> its run id (the Recorder fills it)
    strategy: Strategy = field(default_factory=DDPStrategy)  # how the model's state is gathered and loaded

    def state_dict(self, global_batch_size: int, named: bool = False) -> dict:
        """Everything but the RNGs (gathered from every rank by the Checkpointer); no module. prefixes. named: the
        optimizer keyed by parameter names under ddp too (what a sharded checkpoint is read into)."""
        p = self.progress
        return {**self.strategy.training_state(self.model, self.optimizer, named),  # sharded: this rank's DTensors
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "progress": {"step": p.step, "epoch": p.epoch, "step_in_epoch": p.step_in_epoch,
                             "samples_in_epoch": p.step_in_epoch * global_batch_size},
                **{name: part.state_dict() for name, part in self._parts().items()},
                "trackers": dict(self.tracker_ids)}

    def _parts(self) -> dict:
        """The optional parts with state of their own, by the key their state has in a checkpoint."""
        parts = {"ema": self.ema, "early_stop": self.early_stop, "best": self.best}
        return {name: part for name, part in parts.items() if part is not None}

    def load_state_dict(self, state: dict, global_batch_size: int) -> None:
        self.strategy.load_training_state(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        saved = state["progress"]
        # Position in the epoch by samples, so a changed global batch (forced) lands on the right sample. In place:
        # the training loop holds the object (a replica group healed mid-run reads on from the loaded progress).
        progress = self.progress
        progress.step, progress.epoch = saved["step"], saved["epoch"]
        progress.step_in_epoch = saved["samples_in_epoch"] // global_batch_size
        for name, part in self._parts().items():
            if name in state:
                part.load_state_dict(state[name])
        if self.ema is not None and "ema" not in state:  # EMA turned on when resumed: it starts at these weights
            self.ema.reset()
        self.tracker_ids.update(state.get("trackers", {}))


def new_state(model: nn.Module, config: TrainConfig, total_steps: int | None, device: torch.device,
              best: BestCheckpoints | None = None, log: Callable[[str], None] | None = None,
              strategy: Strategy | None = None) -> TrainState:
    """A fresh state for a model that `strategy` set up (ddp when none is given: a plain or DDP-wrapped model)."""
    optimizer = build_optimizer(model, config, log)
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    ema = EMA(unwrap(model), config.ema_decay) if config.ema_decay else None
    early_stop = EarlyStopping(config.early_stop_metric, config.early_stop_patience,
                               config.early_stop_min_delta) if config.early_stop_metric else None
    return TrainState(model, optimizer, build_scheduler(optimizer, total_steps, config), scaler, ema=ema,
                      early_stop=early_stop, best=best, strategy=strategy or DDPStrategy())


@dataclass(kw_only=True)
class Trainer:
    """Runs the state forward to total_steps (None: a stream's train.epochs passes). Collaborators, all named: what
    it trains (state, loss, config, plan, total_steps), where (device), how it reports (evaluate, recorder, meter),
    what the ranks decide together (agreement), and what it saves (checkpointer, the same contract under every
    strategy)."""

    state: TrainState
    loss: Loss
    config: TrainConfig
    plan: BatchPlan
    total_steps: int | None  # None: unknown, a stream trained by passes (train.epochs bounds it)
    device: torch.device  # this worker's
    evaluate: Callable[[nn.Module], dict]  # exact test metrics of the model (every rank calls it)
    validate: Callable[[nn.Module], dict] | None = None  # exact val_* metrics of a validation set: then evaluations
    # during training are of it (early stopping and best-k watch val_*), and the test set is evaluated at the end
    recorder: Recorder
    meter: Throughput
    agreement: RankAgreement
    checkpointer: Checkpointer | None  # None: no checkpoints
    on_step_end: Callable[[int], None] | None = None  # called with the step after each step's bookkeeping
    callbacks: Callbacks = field(default_factory=Callbacks)  # the user's hooks (distrib.training.callbacks)
    extra_losses: ExtraLosses = field(default_factory=ExtraLosses)  # the model's aux_loss and such: logged
    experts: ExpertLoad | None = None  # a mixture of experts' load: counted, balanced and logged each step
    across: StepAcross | None = None  # what each step agrees on with other worlds (a degree's: its start, its
    # average of the gradients over them, its commit), or None: this world alone
    last_eval: tuple[int, dict] | None = field(default=None, init=False)  # (step, metrics) of the latest evaluation

    def step(self, micro_batches: list[Batch]) -> torch.Tensor | None:
        """One optimizer step, top to bottom: the strategy's forward and backward of the micro-batches (gradients
        synced in the last), the finite check, the rank agreement on sync steps, the update. Returns the loss averaged
        over the global batch (the same on every rank) on sync steps (log steps among them), and this rank's share on
        the others. With other worlds to agree with (`across`) each try starts with their agreement, and a try they
        do not commit is taken again on the same samples; None: the start replaced the state (a live world's, further
        on: the caller reads on from its progress)."""
        while True:
            if self.across is not None and self._start_across():
                return None
            loss = self._try_step(micro_batches)
            if loss is not None:
                return loss

    def _start_across(self) -> bool:
        """The try's start with the other worlds; when no step can be agreed any more, this world checkpoints and
        stops."""
        try:
            return self.across.start_step()
        except AgreementLost as lost:
            self.recorder.info(str(lost))
            raise self._stopped() from None

    def _stopped(self) -> Preempted:
        """A stop at this step boundary: the checkpoint is written, and the Preempted to raise."""
        step = self.state.progress.step
        path = self.checkpointer.save(step) if self.checkpointer else None
        return Preempted(step, path, announce=self.recorder.enabled)  # rank 0's recorder says it once

    def _try_step(self, micro_batches: list[Batch]) -> torch.Tensor | None:
        step = self.state.progress.step + 1
        if self.experts is not None:
            self.experts.start(len(micro_batches))
        local = self.state.strategy.forward_backward(self.state.model, micro_batches, self._step_loss(micro_batches))
        if self.across is not None:  # the gradients (and the loss) averaged over the worlds that took part
            local = self.across.average(self.state.model, local)
            if not self.across.commit():
                self.state.optimizer.zero_grad(set_to_none=True)
                return None
        self._check_finite(step)
        loss = self._agree(local, step) if self.is_sync_step(step) else local
        self._optimizer_step()
        if self.experts is not None:
            self.experts.after_step(self.is_log_step(step))
        return loss

    def _step_loss(self, micro_batches: list[Batch]) -> StepLoss:
        state, config = self.state, self.config
        self.extra_losses.start(self.device)
        return StepLoss(
            loss=step_loss(self.loss, [targets for _, targets in micro_batches],
                           state.strategy.runner.loss_shares(self.agreement.world_size), self.extra_losses),
            forward=forward, autocast=lambda: autocast(config.precision, self.device),
            backward=lambda loss: state.scaler.scale(loss).backward(),
            batch=lambda inputs, targets: {**named(inputs, "inputs"), **named(targets, "targets")},
            device=self.device)

    def _check_finite(self, step: int) -> None:
        every = self.config.finite_check_every
        if every and step % every == 0 and self.config.precision != "fp16":  # fp16's GradScaler skips such steps
            # After DDP's all-reduce the gradients are the same on every rank; under FSDP each rank checks its own
            # shard. Either way the agreement's all-reduce sums the flags, so all ranks stop at the same step.
            self.agreement.check_finite([local_tensor(p.grad) for group in self.state.optimizer.param_groups
                                         for p in group["params"] if p.grad is not None])

    def _optimizer_step(self) -> None:
        state = self.state
        if self.config.grad_clip:
            state.scaler.unscale_(state.optimizer)  # clip the true gradients, not the scaled ones
            state.strategy.clip_grad_norm(state.model, self.config.grad_clip)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.optimizer.zero_grad(set_to_none=True)
        state.scheduler.step()
        if state.ema is not None:
            state.ema.update()

    def is_log_step(self, step: int) -> bool:
        return step % self.config.log_every == 0 or step == self.total_steps

    def is_sync_step(self, step: int) -> bool:
        # Checkpoint steps too: the finite flag is read there, so no checkpoint holds weights that went NaN.
        return (step % self.config.sync_every == 0 or self.is_log_step(step)
                or (self.checkpointer is not None and self.checkpointer.due(step)))

    def _agree(self, local: torch.Tensor, step: int) -> torch.Tensor:
        agreed = self.agreement.agree(local, step, self.extra_losses.sums)
        self.extra_losses.agreed = agreed.extras
        if agreed.nonfinite_since is not None:
            first = agreed.nonfinite_since
            where = f"at step {step}" if first >= step else f"between steps {first} and {step}"
            raise UserError(f"train gradients are not finite {where} (loss {agreed.loss.item():.4g}): training "
                            f"diverged; lower train.lr (now {self.config.lr}), set train.grad_clip=1.0, "
                            "or use more warm-up")
        return agreed.loss

    def _end_step(self, loss: torch.Tensor) -> None:
        """Time, log and checkpoint the step just taken: the save is not step time (the clock restarts after it)."""
        progress = self.state.progress
        logged = self.is_log_step(progress.step)
        loss_value = loss.item() if logged else None  # host sync: only on log steps, so their step times are honest
        self.meter.step_done(self.across.share if self.across else 1.0)
        if logged:
            self.recorder.log_step(progress.step, progress.epoch, loss_value, self.state.scheduler.get_last_lr()[0],
                                   {**self.extra_losses.logged(), **(self.experts.logged() if self.experts else {}),
                                    **(self.across.logged() if self.across else {})},
                                   **self.meter.window())
        if self.agreement.stop_agreed:
            path = self._save(progress.step) if self.checkpointer else None
            raise Preempted(progress.step, path, announce=self.recorder.enabled)  # rank 0's recorder says it once
        if self.checkpointer and self.checkpointer.due(progress.step):
            self._save(progress.step)
            self.meter.restart_clock()
        if self.on_step_end:
            self.on_step_end(progress.step)
        if self.callbacks:
            self.callbacks.on_step_end(progress.step, loss)

    def _save(self, step: int):
        """A checkpoint of this step; the log and metrics.jsonl say how long it held training up."""
        started = time.perf_counter()
        path = self.checkpointer.save(step)
        self.recorder.log_save(step, path, time.perf_counter() - started)
        return path

    def _end_epoch(self) -> None:
        progress = self.state.progress
        progress.epoch, progress.step_in_epoch = progress.epoch + 1, 0
        every = self.config.eval_every_epochs
        if every and progress.epoch % every == 0 and not self.steps_done():
            self._log_eval(self._evaluate())
            self.meter.restart_clock()  # keep evaluation out of the step times

    def _evaluate(self, test: bool = False) -> dict:
        """With a validation set: its val_* metrics, and the test set's only at the end (test); else the test set's."""
        evaluations = [self.validate] if self.validate is not None else []
        if test or self.validate is None:
            evaluations.append(self.evaluate)
        metrics = {}
        for evaluation in evaluations:
            metrics.update(self._with_ema(evaluation))
        return metrics

    def _with_ema(self, evaluation: Callable[[nn.Module], dict]) -> dict:
        metrics = self._forward_only(evaluation)
        if self.state.ema is not None:  # the averaged weights too, on the same samples
            with self.state.ema.swapped_in():
                averaged = self._forward_only(evaluation)
            metrics.update({f"{key}_ema": averaged[key] for key in ("test_loss", "test_accuracy", "val_loss",
                                                                     "val_accuracy") if key in averaged})
        return metrics

    def _forward_only(self, evaluation: Callable[[nn.Module], dict]) -> dict:
        metrics = evaluation(self.state.model)
        self.state.strategy.after_forward_only(self.state.model)  # what a checkpoint saves next: the shards
        return metrics

    def _log_eval(self, metrics: dict) -> dict:
        """Logs an evaluation, keeps the best checkpoints, and decides on early stopping. The metrics are exact and
        the same on every rank, so every rank decides alike, with no collective of its own."""
        state, step = self.state, self.state.progress.step
        self.recorder.log_eval(step, state.progress.epoch, _scalars(metrics))
        if state.best is not None:
            state.best.consider(step, metrics, self.checkpointer)
        if state.early_stop is not None and not state.early_stop.stopped and state.early_stop.update(step, metrics):
            self.recorder.info(state.early_stop.reason())
        self.last_eval = (step, metrics)
        self.callbacks.on_evaluate(step, metrics)
        return metrics

    def steps_done(self) -> bool:
        return self.total_steps is not None and self.state.progress.step >= self.total_steps

    def passes_done(self) -> bool:
        """train.epochs passes over a stream done (map-style data: total_steps already counts its epochs)."""
        return bool(self.config.epochs) and self.state.progress.epoch >= self.config.epochs

    def stopped_early(self) -> bool:
        return self.state.early_stop is not None and self.state.early_stop.stopped

    def stop_reason(self) -> dict:
        if self.stopped_early():
            return {"stop_reason": "early_stop", "stop_detail": self.state.early_stop.reason()}
        return {"stop_reason": "completed", "stop_detail": f"trained {self.state.progress.step} steps"}

    def train(self, train_source) -> dict:
        """Trains from the state's progress to total_steps; evaluates each eval_every_epochs and at the end."""
        progress = self.state.progress
        self.callbacks.on_train_start(unwrap(self.state.model))
        bar = self.recorder.progress_bar(self.total_steps, initial=progress.step)  # None: a count, no total
        self.meter.restart_clock()
        while not self.steps_done() and not self.stopped_early() and not self.passes_done():
            ran_out = True  # the epoch's steps (a stream: the stream) ran out, rather than the run's
            for micro_batches in epoch_steps(train_source, self.plan, progress.epoch, progress.step_in_epoch):
                self.meter.data_ready()  # the time since the previous step ended was spent getting this batch
                loss = self.step(micro_batches)
                if loss is None:  # the state was replaced by a live world's (a heal): read on from its progress
                    ran_out = False
                    break
                progress.step, progress.step_in_epoch = progress.step + 1, progress.step_in_epoch + 1
                bar.update(1)
                self._end_step(loss)
                if progress.step == self.total_steps:
                    ran_out = progress.step_in_epoch == self.plan.steps_per_epoch
                    break
            if ran_out:
                self._end_epoch()
        bar.close()
        if self.checkpointer and (not self.checkpointer.due(progress.step) or self.stopped_early()):
            self._save(progress.step)  # the final state (after the stopping evaluation), to extend it
        if self.across is not None:
            self.across.training_ended(progress.step, self.stop_reason()["stop_reason"])
        if self.last_eval is not None and self.last_eval[0] == progress.step:
            metrics = self.last_eval[1]  # stopped early right after evaluating these weights
            if self.validate is not None:  # on the validation set: the test set only now
                test = self._with_ema(self.evaluate)
                self.recorder.log_eval(progress.step, progress.epoch, _scalars(test))
                metrics = {**metrics, **test}
        else:
            metrics = self._log_eval(self._evaluate(test=True))
        return {**metrics, "train_loss": self.recorder.last_loss, **self.stop_reason()}


def _scalars(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if not isinstance(value, dict)}  # per class: the summary
