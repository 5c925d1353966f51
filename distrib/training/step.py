"""One optimizer step over micro-batches, top to bottom: the strategy's forward and backward, the finite check, the
rank agreement on sync steps, the update; with other worlds to agree with, each try starts and commits with them.

Every rank makes the same collectives in the same order: DDP's bucketed all-reduce in the last micro-step's backward,
one small all-reduce of (loss, extra losses, stop votes, finite flag) on sync steps (distrib.agreement)."""

from __future__ import annotations

import torch

from distrib.data import Batch
from distrib.data.samples import named
from distrib.distributed.across import AgreementLost
from distrib.distributed.parallel import local_tensor
from distrib.distributed.strategies import StepLoss
from distrib.errors import UserError
from distrib.launch.preempt import Preempted
from distrib.training.evaluation import autocast
from distrib.training.losses import forward, step_loss


class Stepping:
    """The Trainer's step (distrib.training.trainer.Trainer is one): methods only, over the Trainer's fields, kept apart
    so that the step reads alone."""

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
