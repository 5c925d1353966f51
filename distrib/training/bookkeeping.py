"""What follows a step and an epoch: the log line (the loss read on log steps only), checkpoints and a stop at the
step boundary, and evaluations (val_* during training, the test set at the end; the EMA's weights too), which keep
the best checkpoints and decide on early stopping. Every rank evaluates: one all-reduce of the integer sums per
evaluation (distrib.evaluation)."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn as nn

from distrib.launch.preempt import Preempted


class Bookkeeping:
    """The Trainer's bookkeeping around its steps (distrib.training.trainer.Trainer is one): methods only, over the
    Trainer's fields."""

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

    def _final_metrics(self) -> dict:
        """The evaluation at the end, unless the run stopped early right after evaluating these weights (then only
        the test set, where the evaluations were of a validation set)."""
        progress = self.state.progress
        if self.last_eval is None or self.last_eval[0] != progress.step:
            return self._log_eval(self._evaluate(test=True))
        metrics = self.last_eval[1]
        if self.validate is not None:  # on the validation set: the test set only now
            test = self._with_ema(self.evaluate)
            self.recorder.log_eval(progress.step, progress.epoch, _scalars(test))
            metrics = {**metrics, **test}
        return metrics

def _scalars(metrics: dict) -> dict:
    return {key: value for key, value in metrics.items() if not isinstance(value, dict)}  # per class: the summary
