"""The state a checkpoint restores (the model, optimizer, schedule, grad scaler, progress and the optional parts with
state of their own), and a fresh one for a model a strategy set up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from distrib.checkpoint import BestCheckpoints
from distrib.config import TrainConfig
from distrib.distributed.parallel import unwrap
from distrib.distributed.strategies import DDPStrategy, Strategy
from distrib.training.early_stop import EarlyStopping
from distrib.training.ema import EMA
from distrib.training.optimizers import build_optimizer, build_scheduler


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

