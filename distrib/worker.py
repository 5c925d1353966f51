"""One worker per device: wiring only, from a config to a trained model, metrics and a summary in run.dir.

One CPU, no launcher:        distrib train --config configs/debug_cpu.toml
N workers on one node:       distrib train --nproc-per-node 2 --config configs/ddp_cpu.toml
                             torchrun --standalone --nproc-per-node 2 -m distrib train --config configs/ddp_cpu.toml
A SLURM cluster:             sbatch --nodes 2 scripts/slurm/train.sbatch configs/cluster.toml
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.nn as nn

from distrib.checkpoint import BestCheckpoints, Checkpointer, CheckpointError, committing, make_checkpointer
from distrib.checkpoint.init_from import check_weights, clear_weights, load_weights, open_source
from distrib.checkpoint.resume import resumable
from distrib.checkpoint.run_weights import write_run_weights
from distrib.checkpoint.weight_files import WEIGHTS_DIR
from distrib.config import Config, to_dict, write_resolved
from distrib.data import Data, load_data, make_plan
from distrib.data.batching import load_source_state, source_state
from distrib.data.split import split_validation
from distrib.distributed import dimensions
from distrib.distributed.agreement import RankAgreement
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import memory_report, sync_batchnorm, unwrap
from distrib.distributed.runtime import LaunchEnv, Runtime, collective_timeouts, open_runtime
from distrib.distributed.strategies import Build, LoadWeights, check_config, make_strategy
from distrib.distributed.strategies.materialise import init_seeded
from distrib.errors import ConfigError, say
from distrib.factory import accepted, call_factory
from distrib.launch import allocator
from distrib.launch.preempt import Preempted, parse_signals, stop_on_signals
from distrib.launch.rundir import checkpoint_dir, environment_faults, own_folders
from distrib.metrics import Recorder
from distrib.metrics.recorder import headline
from distrib.models import adapters
from distrib.models.build import batchnorm_layers, build_model, data_kwargs
from distrib.training.callbacks import Callbacks, from_config
from distrib.training.evaluation import MetricFn, Task, evaluate
from distrib.training.experts import ExpertLoad
from distrib.training.extra_losses import ExtraLosses
from distrib.training.losses import Loss, LossFn, build_loss
from distrib.training.notes import task_notes
from distrib.training.optimizers import check_user_optimizer
from distrib.training.preflight import dry_batch, dry_forward, task_for
from distrib.training.startup import StartupClock
from distrib.training.throughput import flops_per_sample, meter_for, tokens_per_sample, whole_on_meta
from distrib.training.trainer import Trainer, TrainState, new_state

ModelArg = nn.Module | Callable[..., nn.Module] | None  # distrib.fit's model: a module, a function, or the config's


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


def _total_steps(config: Config, steps_per_epoch: int | None) -> int | None:
    """The run's optimizer steps; None for a stream with no train.max_steps: then train.epochs passes bound it, each
    ending when the stream does, so the count is known only at the end."""
    train = config.train
    if steps_per_epoch is None:  # a stream: train.epochs counts its passes, which end when the stream does
        if not train.max_steps and train.schedule == "cosine" and not train.schedule_steps:
            raise ConfigError("train.max_steps = 0: the training data is a stream, whose length is unknown until it "
                              "ends, and train.schedule = cosine needs the run's length; fix: --set train.max_steps=N, "
                              "or --set train.schedule_steps=N (the cosine's length), or --set train.schedule=constant "
                              f"(then train.epochs = {train.epochs} passes over the stream end the run)")
        return train.max_steps or None
    by_epochs = train.epochs * steps_per_epoch
    by_steps = train.max_steps
    return min(by_epochs, by_steps) if by_epochs and by_steps else by_epochs or by_steps


def _steps_said(config: Config, total_steps: int | None) -> str:
    """The run's length for its opening line: a stream trained by passes says it is unknown until they end."""
    if total_steps is not None:
        return f"{total_steps} steps"
    return (f"an unknown number of steps (train.epochs = {config.train.epochs} passes over the stream, each ending "
            "when the stream does)")


def _best(config: Config, runtime: Runtime) -> BestCheckpoints | None:
    ckpt = config.checkpoint
    return BestCheckpoints(ckpt.keep_best, ckpt.best_metric, checkpoint_dir(config), runtime.is_main) \
        if ckpt.keep_best else None


def _checkpointer(config: Config, runtime: Runtime, state: TrainState, global_batch_size: int,
                  data: Data) -> Checkpointer:
    def collect(named: bool = False) -> dict:  # named: the view a sharded checkpoint is loaded into
        # Every rank's position in a stream, gathered like the RNG states (not for the view: no collective there).
        position = {} if named else {"data_state": source_state(data.train)}
        return {**state.state_dict(global_batch_size, named), "config": to_dict(config),
                "world_size": runtime.world_size, "data_seed": config.train.seed,
                "global_batch_size": global_batch_size, "data": data.info.to_dict(), **position}

    return make_checkpointer(config.checkpoint, state.strategy, checkpoint_dir(config), runtime, collect,
                             run_config=to_dict(config), identify=data.identity)


def _training(config: Config, runtime: Runtime, state: TrainState, plan, data: Data, recorder: Recorder,
              total_steps: int | None) -> dimensions.Training:
    """What the degrees' hooks around the training steps read (a Checkpointer of another world's checkpoint.dir: one
    that finished the run, to take its final state from)."""
    return dimensions.Training(config, runtime, state, plan, recorder, total_steps, lambda other: _checkpointer(
        other, runtime, state, plan.global_batch_size, data))


def _resume(state: TrainState, config: Config, runtime: Runtime, checkpointer: Checkpointer,
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


def _finished_summary(config: Config, runtime: Runtime, state: TrainState, total_steps: int | None
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


def _build(config: Config, runtime: Runtime, data: Data, model: ModelArg, notes: list[str],
           resuming: bool) -> Build:
    """How the strategy builds the config's model (or distrib.fit's: a module as it is, or a function of the data's
    sizes), with SyncBatchNorm if asked."""
    def with_norms(built: nn.Module) -> nn.Module:
        return sync_batchnorm(built, runtime) if config.dist.sync_batchnorm else built

    def factory() -> nn.Module:
        if model is None:
            return with_norms(build_model(config.model, data.info))
        spec = getattr(model, "__qualname__", repr(model))
        built = call_factory("fit(model=...)", spec, model, accepted(model, data_kwargs(data.info)))
        if not isinstance(built, nn.Module):
            raise TypeError(f"fit(model=...): {spec} returned {type(built).__name__}, not an nn.Module")
        return with_norms(built)

    given = with_norms(model) if isinstance(model, nn.Module) else None
    return Build(factory, config.train.seed, config.speed, config.train.precision, given=given,
                 load_weights=_init_from(config, notes, resuming), log=notes.append,
                 dry_forward=dry_forward(data.train))


def _init_from(config: Config, notes: list[str], resuming: bool = False) -> LoadWeights | None:
    """model.init_from, read by the strategy's build in place of the model's initialisation: names and shapes checked
    first (one line, exit 2, before anything is written), then every rank reads the blocks it holds (under ddp the
    whole); an EMA starts from them. resuming: checkpoint.dir holds a checkpoint to resume, which holds every weight,
    so the file is not read and the weights are zeros until the checkpoint is loaded over them."""
    if not config.model.init_from:
        return None

    def load(model: nn.Module) -> None:
        if resuming:
            clear_weights(model)
            notes.append(f"model.init_from {config.model.init_from}: not read, the run resumes from its checkpoint "
                         "(which holds every weight)")
        else:
            pretrained = check_weights(model, open_source(config.model.init_from))
            notes.append(load_weights(model, pretrained))
            if pretrained.kept:  # a peft adapter: peft's own init, the same bits under every strategy and world size
                init_seeded(lambda: adapters.reset_adapters(model), config.train.seed)

    return load


def _resuming(config: Config, runtime: Runtime) -> bool:
    """Whether the run will resume (rank 0 looks at checkpoint.dir's names; every rank hears it), decided before the
    model is built only for model.init_from, which is then not read; decided for good under run.dir's lock."""
    if not config.model.init_from:
        return False
    found = [resumable(config.checkpoint.resume, checkpoint_dir(config)) if runtime.is_main else None]
    dist.broadcast_object_list(found, src=0)
    return bool(found[0])


def _init_from_after_all(config: Config, state: TrainState, notes: list[str]) -> None:
    """model.init_from into the model of a run that found a checkpoint to resume at start-up but none under the lock
    (each one damaged, beside another run's: checkpoint.foreign = keep): the run starts afresh from the file after
    all, and so does its EMA."""
    _init_from(config, notes)(unwrap(state.model))
    if state.ema is not None:
        state.ema.reset()


def _model_notes(config: Config, model: nn.Module) -> list[str]:
    norms = batchnorm_layers(model)
    if config.dist.sync_batchnorm or not norms:
        return []
    return [f"the model has {len(norms)} BatchNorm layers ({norms[0]}, ...): their statistics are per micro-batch, "
            "so runs at other world sizes or grad_accum_steps no longer agree exactly; on GPUs, --set "
            "dist.sync_batchnorm=true computes them over each micro-step's global batch (frozen ones: a callback "
            "keeps them in eval mode: docs/training-features.md, Callbacks)"]


def train_on(config: Config, runtime: Runtime, on_step_end: Callable[[int], None] | None = None, *,
             data: Data | None = None, model: ModelArg = None, loss_fn: LossFn | None = None,
             metrics: tuple[MetricFn, ...] = (), callbacks: tuple = ()) -> dict:
    """Trains inside an open process group; returns the run's summary. Everything that can fail on the user's input
    (data, model, the dry batch, the checkpoint to resume) runs before anything is written to run.dir, so a run that
    fails leaves an earlier run's files there as they were. on_step_end(step) runs after each step's bookkeeping;
    callbacks (after train.callbacks') get the hooks of distrib.training.callbacks."""
    check_config(config)  # checked before any worker too; here for a Config built in Python
    strategy = make_strategy(config.dist, runtime.world_size, runtime.local_world_size)
    dims = strategy.dims  # the run's one mesh: every rank's coordinates, the data slices and the loss count
    start, notes, clock = time.perf_counter(), [], StartupClock()
    data = split_validation(data or load_data(config.data, runtime, config.train.seed), config.data)
    clock.mark("data")
    if data.val is not None:
        notes.append(f"validation: {data.val.num_samples} samples"
                     + (f" held out of the training set (data.val_fraction = {config.data.val_fraction})"
                        if config.data.val_fraction else "") + ", evaluated during training (val_*); the test set "
                     "at the end")
    plan = make_plan(data.train.num_samples, config.train, runtime, dims)
    strategy.check_micro_batch(plan.micro_batch_size)
    total_steps = _total_steps(config, plan.steps_per_epoch)
    if total_steps is None and config.train.schedule == "cosine":  # its length given by train.schedule_steps
        notes.append(f"the cosine schedule spans train.schedule_steps = {config.train.schedule_steps} steps; a "
                     "stream's steps are not known ahead, and any past that many train at a learning rate of 0")
    # Built, materialised (under sharded strategies: only this rank's shards), given model.init_from's weights,
    # placed and wrapped; the checks below run the plain module under the wrappers.
    resuming = _resuming(config, runtime)
    build = _build(config, runtime, data, model, notes, resuming)
    whole = whole_on_meta(build.factory, build.given)  # for the FLOP count, taken before a strategy shards
    wrapped = strategy.setup_module(build, runtime)
    placed = unwrap(wrapped)
    clock.mark("model (build, weights, wrap)")
    notes += _model_notes(config, placed)
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
    strategy.after_forward_only(wrapped)  # the checks above ran forwards only: the optimizer must get the shards
    clock.mark("checks (dry batch, FLOP count)")
    # Only now, once the user's input passed: rank 0 locks run.dir and checkpoint.dir for the rest of the run (a
    # refused run wrote nothing, not even a lock file); the resume choice below is made under the lock. Under a
    # sharded strategy every rank writes its part of weights/ and of each checkpoint: each checks it sees them.
    with own_folders(config, runtime, every_rank_writes=strategy.sharded_state):
        state = new_state(wrapped, config.train, total_steps, runtime.device, best=_best(config, runtime),
                          log=notes.append, strategy=strategy)
        checkpointer = _checkpointer(config, runtime, state, plan.global_batch_size, data)
        resumed_from = _resume(state, config, runtime, checkpointer, plan.global_batch_size, data, notes)
        if resuming and resumed_from is None:
            _init_from_after_all(config, state, notes)
        finished = _finished_summary(config, runtime, state, total_steps) if resumed_from is not None else None
        if finished is not None:
            return finished  # nothing written: summary.json, config.toml and metrics.jsonl stay as they were
        recorder = Recorder(Path(config.run.dir), runtime.is_main, config.run.progress, metrics=config.metrics,
                            run_ids=state.tracker_ids)
        if runtime.is_main:  # only now: a run that failed above left the earlier run's config.toml as it was
            write_resolved(config, Path(config.run.dir))
        recorder.info(f"world size {runtime.world_size}, device {runtime.device}, backend {runtime.backend}"
                      + (f", host allocator {allocator.running()}" if runtime.device.type == "cpu" else ""))
        for note in notes:
            recorder.info(note)
        ranks = (f"{runtime.world_size} ranks" if dims.data_parallel == runtime.world_size else
                 f"{dims.data_parallel} data-parallel ranks of {runtime.world_size}")
        recorder.info(f"{_steps_said(config, total_steps)} of {plan.global_batch_size} samples ({ranks} x "
                      f"{config.train.grad_accum_steps} micro-steps x {plan.micro_batch_size}), "
                      f"{type(data.train).__name__}")
        experts = ExpertLoad.of(wrapped, strategy, runtime.device)  # a mixture of experts' load, counted each step
        if experts is not None:
            recorder.info(experts.describe(dims))
        recorder.start(to_dict(config), resumed_from, runtime.restart_count)  # trackers: fail here, not mid-run
        clock.mark("state, resume and trackers")
        recorder.info(clock.line())
        try:
            with stop_on_signals(parse_signals(config.checkpoint.signals)) as stop, \
                    collective_timeouts(config.dist.timeout_s, lambda: f"after step {state.progress.step}",
                                        runtime.peers), \
                    committing(checkpointer), \
                    dimensions.around_training(_training(config, runtime, state, plan, data, recorder,
                                                         total_steps)) as across:
                agreement = RankAgreement(stop, runtime.device, runtime.world_size, synced_at=state.progress.step,
                                          loss_ranks=dims.loss_ranks)
                evaluator = _evaluator(config, runtime, dims, data, loss, task)
                validator = _evaluator(config, runtime, dims, data, loss, task, "val") if validation else None
                trainer = Trainer(state=state, loss=loss, config=config.train, device=runtime.device, plan=plan,
                                  total_steps=total_steps, evaluate=evaluator, validate=validator, recorder=recorder,
                                  meter=meter,
                                  agreement=agreement, checkpointer=checkpointer,
                                  on_step_end=_after_step(runtime, on_step_end), callbacks=hooks,
                                  extra_losses=extra_losses, experts=experts,
                                  across=across)
                metrics = trainer.train(data.train)
        except BaseException as e:  # flush metrics and trackers now: the CLI's os._exit skips finalisers
            recorder.close("preempted" if isinstance(e, Preempted) else "failed")
            raise
        summary = _finish(config, runtime, data, state, metrics, meter, recorder, resumed_from, start,
                          model is None)
        hooks.on_train_end(summary)
        return summary


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


def _evaluator(config: Config, runtime: Runtime, dims: ParallelDims, data: Data, loss: Loss, task: Task,
               split: str = "test") -> Callable[[nn.Module], dict]:
    """Exact metrics of the test set, or of the validation set (split "val": the same metrics named val_*)."""
    source = data.val if split == "val" else data.test

    def evaluate_model(model: nn.Module) -> dict:
        metrics = evaluate(model, source, data.info.num_classes, config.data.eval_batch_size, runtime, loss,
                           config.train.precision, data.info.class_names, task, dims)
        return {f"{split}_{key.removeprefix('test_')}" if key.startswith("test_") else key: value
                for key, value in metrics.items()}

    return evaluate_model


def _memory(config: Config, runtime: Runtime, state: TrainState, recorder: Recorder) -> dict:
    """state_bytes_per_rank (and peak_memory_bytes on CUDA), the fullest rank's, into the log. A collective."""
    memory = memory_report(state.model, state.optimizer, runtime)
    peak, dims = memory["peak_memory_bytes"], state.strategy.dims
    layout = dimensions.layout_words(dims)  # spelt out where the strategy's name does not say what a rank holds
    recorder.info(f"parameters + gradients + optimizer state: {memory['state_bytes_per_rank'] / 2**20:.1f} MiB on "
                  f"the fullest rank ({config.dist.strategy}{layout})"
                  + (f"; peak device memory {peak / 2**20:.1f} MiB" if peak else ""))
    return memory


def _finish(config: Config, runtime: Runtime, data: Data, state: TrainState, metrics: dict, meter, recorder,
            resumed_from: int | None, start: float, from_config: bool) -> dict:
    """The weights (weights/, and model.pt where it is cheap), model.json (which says how to rebuild a config's
    model), summary.json, the last log line."""
    run_dir = Path(config.run.dir)
    written = write_run_weights(unwrap(state.model), state.ema, run_dir, runtime.rank, state.strategy,
                                config.model.init_from, config.model.merged_weights, recorder.info,
                                config.model.max_shard_bytes)
    memory = _memory(config, runtime, state, recorder)
    if runtime.is_main:
        if from_config:  # a model given to distrib.fit in Python has no factory that model.json could name
            from distrib.training.inference import write_model_card

            write_model_card(run_dir / "model.json", config, data.info,
                             "model.pt" if "model.pt" in written else f"{WEIGHTS_DIR}/")
    elapsed = time.perf_counter() - start
    summary = {"world_size": runtime.world_size, "device": str(runtime.device), "backend": runtime.backend,
               "steps": state.progress.step, "epochs": state.progress.epoch, **metrics,
               "resumed_from_step": resumed_from, "restart_count": runtime.restart_count,
               **({"best_checkpoints": state.best.describe()} if state.best else {}),
               **meter.summary(), **memory, "elapsed_seconds": elapsed, "data": data.info.to_dict()}
    recorder.write_summary(summary)
    recorder.info(f"done in {elapsed:.1f}s: {headline(metrics)}, summary in {run_dir / 'summary.json'}")
    recorder.close()
    return summary
