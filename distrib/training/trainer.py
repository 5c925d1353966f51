"""The training loop: the Trainer runs the state forward, epoch by epoch, to the run's end, with its step
(distrib.training.step) and what follows each step and epoch (distrib.training.bookkeeping).

Every rank makes the same collectives in the same order: DDP's bucketed all-reduce in the last micro-step's backward,
one small all-reduce of (loss, extra losses, stop votes, finite flag) on sync steps (distrib.agreement), one
all-reduce of the integer sums per evaluation (distrib.evaluation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from distrib.checkpoint import Checkpointer
from distrib.config import TrainConfig
from distrib.data import BatchPlan, epoch_steps
from distrib.distributed.across import StepAcross
from distrib.distributed.agreement import RankAgreement
from distrib.distributed.parallel import unwrap
from distrib.metrics import Recorder
from distrib.training.bookkeeping import Bookkeeping
from distrib.training.callbacks import Callbacks
from distrib.training.experts import ExpertLoad
from distrib.training.extra_losses import ExtraLosses
from distrib.training.losses import Loss
from distrib.training.state import TrainState
from distrib.training.step import Stepping
from distrib.training.throughput import Throughput


@dataclass(kw_only=True)
class Trainer(Stepping, Bookkeeping):
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
        return {**self._final_metrics(), "train_loss": self.recorder.last_loss, **self.stop_reason()}
