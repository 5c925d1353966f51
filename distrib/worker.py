"""One worker per device: wiring only, from a config to a trained model, metrics and a summary in run.dir.

One CPU, no launcher:        distrib train --config configs/debug_cpu.toml
N workers on one node:       distrib train --nproc-per-node 2 --config configs/ddp_cpu.toml
                             torchrun --standalone --nproc-per-node 2 -m distrib train --config configs/ddp_cpu.toml
A SLURM cluster:             sbatch --nodes 2 scripts/slurm/train.sbatch configs/cluster.toml
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from distrib.checkpoint import Checkpointer, CheckpointError, check_compatible, save_atomic, set_rng_state
from distrib.config import Config, to_dict, write_resolved
from distrib.data import load_splits, make_batches, make_plan
from distrib.metrics import Recorder
from distrib.models import build_model
from distrib.parallel import parallelize, place_model, unwrap
from distrib.preempt import parse_signals, stop_on_signals
from distrib.rundir import checkpoint_dir, environment_faults, own_folders
from distrib.runtime import LaunchEnv, Runtime, collective_timeouts, open_runtime
from distrib.throughput import meter_for
from distrib.train import Trainer, build_optimizer, build_scheduler


def run(config: Config, env: LaunchEnv | None = None) -> dict:
    """Trains on this worker's device inside an open process group; returns the run's summary."""
    with environment_faults(), open_runtime(config.dist, env) as runtime, own_folders(config, runtime):
        return train_on(config, runtime)  # run.dir and checkpoint.dir locked for the run's life


def _total_steps(config: Config, steps_per_epoch: int) -> int:
    by_epochs = config.train.epochs * steps_per_epoch
    by_steps = config.train.max_steps
    return min(by_epochs, by_steps) if by_epochs and by_steps else by_epochs or by_steps


def _resume(trainer: Trainer, config: Config, runtime: Runtime, recorder: Recorder) -> int | None:
    """Loads the checkpoint that rank 0 chose into the trainer and arms periodic checkpoints; the resumed step."""
    ckpt = config.checkpoint
    trainer.checkpointer = Checkpointer(checkpoint_dir(config), ckpt.every_steps, ckpt.keep_last, runtime,
                                        lambda: {**trainer.state_dict(), "config": to_dict(config),
                                                 "world_size": runtime.world_size, "data_seed": config.train.seed,
                                                 "global_batch_size": config.train.global_batch_size},
                                        foreign=ckpt.foreign)
    state = trainer.checkpointer.load(ckpt.resume, recorder.info)
    if state is None:
        return None
    path = trainer.checkpointer.resumed_from
    changed = check_compatible(str(path), state["config"], to_dict(config), ckpt.allow_config_change)
    try:
        trainer.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError) as e:  # another model's or optimizer's tensors
        reason = " ".join(str(e).split()) or type(e).__name__  # torch's reasons follow a header line: keep them
        raise CheckpointError(f"checkpoint {path}: does not fit this run's model or optimizer "
                              f"({type(e).__name__}: {reason[:300]}); resume it with the config it was taken with, "
                              "or start afresh with a new run.dir") from None
    if state["world_size"] == runtime.world_size:  # per-rank RNG streams only map onto the same ranks
        set_rng_state(state["rng"][runtime.rank], runtime)
    recorder.info(f"resumed at step {trainer.progress.step} (epoch {trainer.progress.epoch}) from a checkpoint "
                  f"taken at world size {state['world_size']}; restart count {runtime.restart_count}"
                  + (f"; allowed changes: {'; '.join(changed)}" if changed else ""))
    return trainer.progress.step


def train_on(config: Config, runtime: Runtime) -> dict:
    start = time.perf_counter()
    run_dir = Path(config.run.dir)
    recorder = Recorder(run_dir, runtime.is_main, config.run.progress, config.metrics.tensorboard)
    recorder.info(f"world size {runtime.world_size}, device {runtime.device}, backend {runtime.backend}")

    train_split, test_split = load_splits(config.data, runtime)
    plan = make_plan(len(train_split), config.train, runtime)
    torch.manual_seed(config.train.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's too)
    model = parallelize(place_model(build_model(config.model), runtime.device), runtime, config.speed)
    data_bytes = train_split.nbytes() + test_split.nbytes()
    train_source = make_batches(train_split, config.data, runtime, data_bytes)
    test_source = make_batches(test_split, config.data, runtime, data_bytes)

    total_steps = _total_steps(config, plan.steps_per_epoch)
    optimizer = build_optimizer(model, config.train)
    trainer = Trainer(model, optimizer, build_scheduler(optimizer, total_steps, config.train), config.train,
                      runtime, plan, total_steps, recorder, meter=meter_for(config, runtime))
    resumed_from = _resume(trainer, config, runtime, recorder)
    if runtime.is_main:  # only now: a run that failed above left an earlier run's config.toml as it was
        write_resolved(config, run_dir)
    recorder.info(f"{total_steps} steps of {plan.global_batch_size} samples ({runtime.world_size} ranks x "
                  f"{config.train.grad_accum_steps} micro-steps x {plan.micro_batch_size}), "
                  f"{type(train_source).__name__}")
    try:
        with stop_on_signals(parse_signals(config.checkpoint.signals)) as trainer.stop, \
                collective_timeouts(config.dist.timeout_s, lambda: f"after step {trainer.progress.step}",
                                    runtime.peers):
            metrics = trainer.fit(train_source, test_source, len(test_split), config.data.eval_batch_size)
    except BaseException:
        recorder.close()  # preempted or failed: flush metrics and TensorBoard now, the CLI's os._exit skips finalisers
        raise

    if runtime.is_main:
        save_atomic(unwrap(model).state_dict(), run_dir / "model.pt")
    elapsed = time.perf_counter() - start
    summary = {"world_size": runtime.world_size, "device": str(runtime.device), "backend": runtime.backend,
               "steps": trainer.progress.step, "epochs": trainer.progress.epoch, **metrics,
               "resumed_from_step": resumed_from, "restart_count": runtime.restart_count,
               **trainer.meter.summary(), "elapsed_seconds": elapsed}
    recorder.write_summary(summary)
    recorder.info(f"done in {elapsed:.1f}s: test accuracy {100 * metrics['test_accuracy']:.2f}%, "
                  f"summary in {run_dir / 'summary.json'}")
    recorder.close()
    return summary
