"""A worker's checkpoints: the Checkpointer of its run (what each checkpoint collects), the one it resumes from and
how it is loaded into the state, and a resumed run that has nothing left to train (its summary, as it was)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from distrib.checkpoint import BestCheckpoints, Checkpointer, CheckpointError, make_checkpointer
from distrib.config import Config, to_dict
from distrib.data import Data
from distrib.data.batching import load_source_state, source_state
from distrib.distributed import dimensions
from distrib.distributed.runtime import Runtime
from distrib.errors import say
from distrib.launch.rundir import checkpoint_dir
from distrib.metrics import Recorder
from distrib.training.state import TrainState


def best_checkpoints(config: Config, runtime: Runtime) -> BestCheckpoints | None:
    """checkpoint.keep_best's k best, or None where it is 0."""
    ckpt = config.checkpoint
    return BestCheckpoints(ckpt.keep_best, ckpt.best_metric, checkpoint_dir(config), runtime.is_main) \
        if ckpt.keep_best else None


def run_checkpointer(config: Config, runtime: Runtime, state: TrainState, global_batch_size: int,
                  data: Data) -> Checkpointer:
    def collect(named: bool = False) -> dict:  # named: the view a sharded checkpoint is loaded into
        # Every rank's position in a stream, gathered like the RNG states (not for the view: no collective there).
        position = {} if named else {"data_state": source_state(data.train)}
        return {**state.state_dict(global_batch_size, named), "config": to_dict(config),
                "world_size": runtime.world_size, "data_seed": config.train.seed,
                "global_batch_size": global_batch_size, "data": data.info.to_dict(), **position}

    return make_checkpointer(config.checkpoint, state.strategy, checkpoint_dir(config), runtime, collect,
                             run_config=to_dict(config), identify=data.identity)


def training_hooks(config: Config, runtime: Runtime, state: TrainState, plan, data: Data, recorder: Recorder,
              total_steps: int | None) -> dimensions.Training:
    """What the degrees' hooks around the training steps read (a Checkpointer of another world's checkpoint.dir: one
    that finished the run, to take its final state from)."""
    return dimensions.Training(config, runtime, state, plan, recorder, total_steps, lambda other: run_checkpointer(
        other, runtime, state, plan.global_batch_size, data))


def resume(state: TrainState, config: Config, runtime: Runtime, checkpointer: Checkpointer,
            global_batch_size: int, data: Data, notes: list[str]) -> int | None:
    """Loads the checkpoint that rank 0 chose (checked against this run's config) into the state; the resumed step,
    or None for a fresh start."""
    loaded = checkpointer.load(config.checkpoint.resume, notes.append)
    if loaded is None:
        return None
    path = checkpointer.resumed_from
    try:
        state.load_state_dict(loaded, global_batch_size)
    except (RuntimeError, KeyError, ValueError, TypeError) as e:  # another model's or optimizer's tensors
        reason = " ".join(str(e).split()) or type(e).__name__  # torch's reasons follow a header line: keep them
        raise CheckpointError(f"checkpoint {path}: does not fit this run's model or optimizer "
                              f"({type(e).__name__}: {reason[:300]}); resume it with the config it was taken with, "
                              "or start afresh with a new run.dir") from None
    load_source_state(data.train, loaded.get("data_state"))  # a stream's position: where each rank reads on
    if state.best and config.checkpoint.resume == "auto":
        state.best.drop_abandoned(state.progress.step, checkpointer.run_id)
    if loaded["world_size"] == runtime.world_size:  # per-rank RNG streams only map onto the same ranks
        runtime.set_rng_state(loaded["rng"][runtime.rank])
    notes.append(f"resumed at step {state.progress.step} (epoch {state.progress.epoch}) from a checkpoint taken at "
                 f"world size {loaded['world_size']}; restart count {runtime.restart_count}")
    return state.progress.step


def finished_summary(config: Config, runtime: Runtime, state: TrainState, total_steps: int | None
                      ) -> dict | None:
    """The summary of a resumed run that has nothing left to train (its steps done, or stopped early), after one line
    that says so and how to retrain or extend; None when steps are left, or when run.dir holds no summary of that
    step (the run ended before writing it: then it ends the usual way, evaluation and summary included)."""
    step, early_stop = state.progress.step, state.early_stop
    stopped_early = early_stop is not None and early_stop.stopped
    passes_done = bool(config.train.epochs) and state.progress.epoch >= config.train.epochs  # a stream's passes
    if (total_steps is None or step < total_steps) and not stopped_early and not passes_done:
        return None
    found = [_read_summary(Path(config.run.dir) / "summary.json", step) if runtime.is_main else None]
    dist.broadcast_object_list(found, src=0)  # every rank returns, or every rank trains on: the same collectives
    summary = found[0]
    if summary is not None and runtime.is_main:
        passes = f"{step} steps in train.epochs = {config.train.epochs} passes done"
        done = (early_stop.reason() if stopped_early else passes if total_steps is None or step < total_steps
                else f"{step} of {total_steps} steps done")
        extend = "" if stopped_early else "; to extend it, raise train.max_steps or train.epochs"
        # Not resume=never in the same folders: the checkpoint contract refuses to start afresh beside another run's.
        say(f"distrib: {config.run.dir}: the run is finished ({done}), nothing to train; its summary.json is left as "
            f"it was. To train afresh, give a new --set run.dir (or move {checkpoint_dir(config)} away){extend}")
    return summary


def _read_summary(path: Path, step: int) -> dict | None:
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):  # none, or unreadable: the run ends the usual way and writes it anew
        return None
    return summary if isinstance(summary, dict) and summary.get("steps") == step else None
