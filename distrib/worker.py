"""One worker per device: wiring only, from a config to a trained model, metrics and a summary in run.dir.

One CPU, no launcher:        distrib train --config configs/debug_cpu.toml
N workers on one node:       distrib train --nproc-per-node 2 --config configs/ddp_cpu.toml
                             torchrun --standalone --nproc-per-node 2 -m distrib train --config configs/ddp_cpu.toml
A SLURM cluster:             sbatch --nodes 2 scripts/slurm/train.sbatch configs/cluster.toml
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.nn as nn

from distrib.checkpoint import Checkpointer, committing
from distrib.config import Config, to_dict, write_resolved
from distrib.data import BatchPlan, Data, load_data, make_plan
from distrib.data.split import split_validation
from distrib.distributed import dimensions
from distrib.distributed.agreement import RankAgreement
from distrib.distributed.parallel import unwrap
from distrib.distributed.runtime import LaunchEnv, Runtime, collective_timeouts, open_runtime
from distrib.distributed.strategies import Strategy, check_config, make_strategy
from distrib.launch.preempt import Preempted, parse_signals, stop_on_signals
from distrib.launch.rundir import environment_faults, own_folders
from distrib.metrics import Recorder
from distrib.training.building import ModelArg, init_from_after_all, model_build, model_notes, will_resume
from distrib.training.callbacks import Callbacks, from_config
from distrib.training.evaluation import MetricFn, Task
from distrib.training.experts import ExpertLoad
from distrib.training.extra_losses import ExtraLosses
from distrib.training.finish import evaluator, finish_run
from distrib.training.losses import Loss, LossFn, build_loss
from distrib.training.notes import task_notes
from distrib.training.opening import count_steps, data_notes, opening_lines
from distrib.training.optimizers import check_user_optimizer
from distrib.training.preflight import dry_batch, task_for
from distrib.training.resuming import best_checkpoints, finished_summary, resume, run_checkpointer, training_hooks
from distrib.training.startup import StartupClock
from distrib.training.state import TrainState, new_state
from distrib.training.throughput import Throughput, flops_per_sample, meter_for, tokens_per_sample, whole_on_meta
from distrib.training.trainer import Trainer


def run_training(config: Config, env: LaunchEnv | None = None) -> dict:
    """Trains on this worker's device inside an open process group; returns the run's summary."""
    with environment_faults(), open_runtime(config.dist, env, Path(config.run.dir)) as runtime, \
            peers_lost(config, runtime):
        return train_on(config, runtime)  # which locks run.dir and checkpoint.dir once the input is checked


def peers_lost(config: Config, runtime: Runtime):
    """Before and after the training steps too (which say their step themselves), a peer that died or hangs is one
    line naming it (PeerLostError, CollectiveTimeoutError), not gloo's traceback: e.g. rank 0 waiting in the run.dir
    lock's broadcast while rank 1 failed on its input."""
    return collective_timeouts(config.dist.timeout_s, lambda: "outside the training steps", runtime.peers)


@dataclass(frozen=True, kw_only=True)
class Checked:
    """What the checks of the user's input leave for the run, before anything is written to run.dir: the layout, the
    data and its batch plan, the model set up (wrapped), its loss and task, and what the log will open with."""

    strategy: Strategy
    data: Data
    plan: BatchPlan
    total_steps: int | None  # None: a stream trained by passes
    resuming: bool  # model.init_from was not read: the run resumes from a checkpoint (decided for good under the lock)
    model: nn.Module  # as the strategy set it up (wrapped)
    loss: Loss
    task: Task
    extra_losses: ExtraLosses
    callbacks: Callbacks
    meter: Throughput
    notes: list[str]  # the log's opening notes; appended to until the run opens its log
    clock: StartupClock
    started: float  # time.perf_counter() at the start: the summary's elapsed_seconds


def train_on(config: Config, runtime: Runtime, on_step_end: Callable[[int], None] | None = None, *,
             data: Data | None = None, model: ModelArg = None, loss_fn: LossFn | None = None,
             metrics: tuple[MetricFn, ...] = (), callbacks: tuple = ()) -> dict:
    """Trains inside an open process group; returns the run's summary. Everything that can fail on the user's input
    (data, model, the dry batch, the checkpoint to resume) runs before anything is written to run.dir, so a run that
    fails leaves an earlier run's files there as they were. on_step_end(step) runs after each step's bookkeeping;
    callbacks (after train.callbacks') get the hooks of distrib.training.callbacks."""
    check_config(config)  # checked before any worker too; here for a Config built in Python
    checked = _check_input(config, runtime, data, model, loss_fn, metrics, callbacks)
    # Only now, once the user's input passed: rank 0 locks run.dir and checkpoint.dir for the rest of the run (a
    # refused run wrote nothing, not even a lock file); the resume choice below is made under the lock. Under a
    # sharded strategy every rank writes its part of weights/ and of each checkpoint: each checks it sees them.
    with own_folders(config, runtime, every_rank_writes=checked.strategy.sharded_state):
        state = new_state(checked.model, config.train, checked.total_steps, runtime.device,
                          best=best_checkpoints(config, runtime), log=checked.notes.append, strategy=checked.strategy)
        checkpointer = run_checkpointer(config, runtime, state, checked.plan.global_batch_size, checked.data)
        resumed_from = resume(state, config, runtime, checkpointer, checked.plan.global_batch_size, checked.data,
                              checked.notes)
        if checked.resuming and resumed_from is None:
            init_from_after_all(config, state, checked.notes)
        finished = finished_summary(config, runtime, state, checked.total_steps) if resumed_from is not None else None
        if finished is not None:
            return finished  # nothing written: summary.json, config.toml and metrics.jsonl stay as they were
        recorder, experts = _open_log(config, runtime, checked, state, resumed_from)
        try:
            metrics = _train_steps(config, runtime, checked, state, checkpointer, recorder, experts, on_step_end)
        except BaseException as e:  # flush metrics and trackers now: the CLI's os._exit skips finalisers
            recorder.close("preempted" if isinstance(e, Preempted) else "failed")
            raise
        summary = finish_run(config, runtime, checked.data, state, metrics, checked.meter, recorder, resumed_from,
                             checked.started, model is None)
        checked.callbacks.on_train_end(summary)
        return summary


def _check_input(config: Config, runtime: Runtime, data: Data | None, model: ModelArg, loss_fn: LossFn | None,
                 metrics: tuple[MetricFn, ...], callbacks: tuple) -> Checked:
    """The data, its plan and the model, built and checked on a dry batch; nothing written yet."""
    strategy = make_strategy(config.dist, runtime.world_size, runtime.local_world_size)
    started, notes, clock = time.perf_counter(), [], StartupClock()
    data = split_validation(data or load_data(config.data, runtime, config.train.seed), config.data)
    clock.mark("data")
    # the run's one mesh (strategy.dims): every rank's coordinates, the data slices and the loss count
    plan = make_plan(data.train.num_samples, config.train, runtime, strategy.dims)
    strategy.check_micro_batch(plan.micro_batch_size)
    total_steps = count_steps(config, plan.steps_per_epoch)
    notes += data_notes(config, data, total_steps)
    # Built, materialised (under sharded strategies: only this rank's shards), given model.init_from's weights,
    # placed and wrapped; the checks below run the plain module under the wrappers.
    resuming = will_resume(config, runtime)
    build = model_build(config, runtime, data, model, notes, resuming)
    whole = whole_on_meta(build.factory, build.given)  # for the FLOP count, taken before a strategy shards
    wrapped = strategy.setup_module(build, runtime)
    clock.mark("model (build, weights, wrap)")
    notes += model_notes(config, unwrap(wrapped))
    checks = _dry_checks(config, runtime, strategy, data, wrapped, whole, total_steps, loss_fn, metrics, callbacks,
                         notes)
    strategy.after_forward_only(wrapped)  # the checks above ran forwards only: the optimizer must get the shards
    clock.mark("checks (dry batch, FLOP count)")
    return Checked(strategy=strategy, data=data, plan=plan, total_steps=total_steps, resuming=resuming,
                   model=wrapped, **checks, notes=notes, clock=clock, started=started)


def _dry_checks(config: Config, runtime: Runtime, strategy: Strategy, data: Data, wrapped: nn.Module,
                whole: nn.Module | None, total_steps: int | None, loss_fn: LossFn | None,
                metrics: tuple[MetricFn, ...], callbacks: tuple, notes: list[str]) -> dict:
    """A dry batch through the model: the loss and the task it implies, the watched metrics, the optimizer and the
    callbacks checked, the FLOP and token counts (Checked's fields by name); their notes appended."""
    placed = unwrap(wrapped)
    dry = dry_batch(placed, data.train, data.info, runtime.device, build_loss(config.train, loss_fn))
    loss, task = dry.loss, task_for(dry, config.metrics.eval, metrics)
    extra_losses = ExtraLosses.of(dry.outputs, loss, strategy.logs_extra_losses)  # a collective
    notes += [line for line in (dry.note, extra_losses.note(loss)) if line]
    validation = data.val is not None
    task.check_watched("train.early_stop_metric", config.train.early_stop_metric, validation)
    task.check_watched("checkpoint.best_metric", config.checkpoint.best_metric if config.checkpoint.keep_best else "",
                       validation)
    check_user_optimizer(config.train)
    hooks = Callbacks([*from_config(config.train.callbacks), *callbacks])
    notes += task_notes(config.train, loss, task, placed, total_steps)
    meter = meter_for(config, runtime)
    meter.flops_per_sample = flops_per_sample(placed if whole is None else whole, dry.inputs, dry.targets, loss)
    meter.tokens_per_sample = tokens_per_sample(dry.inputs)
    return {"loss": loss, "task": task, "extra_losses": extra_losses, "callbacks": hooks, "meter": meter}


def _open_log(config: Config, runtime: Runtime, checked: Checked, state: TrainState, resumed_from: int | None
              ) -> tuple[Recorder, ExpertLoad | None]:
    """The run's recorder, its resolved config.toml and opening lines, and its trackers started; with the load of a
    mixture of experts, counted each step."""
    recorder = Recorder(Path(config.run.dir), runtime.is_main, config.run.progress, metrics=config.metrics,
                        run_ids=state.tracker_ids)
    if runtime.is_main:  # only now: a run that failed above left the earlier run's config.toml as it was
        write_resolved(config, Path(config.run.dir))
    dims = checked.strategy.dims
    opening_lines(recorder, config, runtime, dims, checked.plan, checked.total_steps, checked.data, checked.notes)
    experts = ExpertLoad.of(checked.model, checked.strategy, runtime.device)
    if experts is not None:
        recorder.info(experts.describe(dims))
    recorder.start(to_dict(config), resumed_from, runtime.restart_count)  # trackers: fail here, not mid-run
    checked.clock.mark("state, resume and trackers")
    recorder.info(checked.clock.line())
    return recorder, experts


def _train_steps(config: Config, runtime: Runtime, checked: Checked, state: TrainState, checkpointer: Checkpointer,
                 recorder: Recorder, experts: ExpertLoad | None, on_step_end: Callable[[int], None] | None) -> dict:
    """The training steps, under what surrounds them: stop signals, collective timeouts that name the step, the
    checkpointer's commits and the degrees' hooks; the Trainer's final metrics."""
    dims, data, plan, total_steps = checked.strategy.dims, checked.data, checked.plan, checked.total_steps
    hooks = training_hooks(config, runtime, state, plan, data, recorder, total_steps)
    with stop_on_signals(parse_signals(config.checkpoint.signals)) as stop, \
            collective_timeouts(config.dist.timeout_s, lambda: f"after step {state.progress.step}", runtime.peers), \
            committing(checkpointer), dimensions.around_training(hooks) as across:
        agreement = RankAgreement(stop, runtime.device, runtime.world_size, synced_at=state.progress.step,
                                  loss_ranks=dims.loss_ranks)
        loss, task = checked.loss, checked.task
        trainer = Trainer(state=state, loss=loss, config=config.train, device=runtime.device, plan=plan,
                          total_steps=total_steps, evaluate=evaluator(config, runtime, dims, data, loss, task),
                          validate=evaluator(config, runtime, dims, data, loss, task, "val")
                          if data.val is not None else None,
                          recorder=recorder, meter=checked.meter, agreement=agreement, checkpointer=checkpointer,
                          on_step_end=_after_step(runtime, on_step_end), callbacks=checked.callbacks,
                          extra_losses=checked.extra_losses, experts=experts, across=across)
        return trainer.train(data.train)


def _after_step(runtime: Runtime, on_step_end: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """A heartbeat that names the step just finished (a stopped rank is then named at its true step), then the
    caller's on_step_end."""
    peers = runtime.peers
    if peers is None:
        return on_step_end

    def after_step(step: int) -> None:
        peers.step_done()
        if on_step_end:
            on_step_end(step)

    return after_step
