"""A worker's run length and the lines its log opens with: how many steps (unknown for a stream trained by passes),
the validation set and a stream's cosine schedule, then the world, device and backend, the notes gathered at start-up
and the batch layout."""

from __future__ import annotations

from distrib.config import Config
from distrib.data import BatchPlan, Data
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError
from distrib.launch import allocator
from distrib.metrics import Recorder


def count_steps(config: Config, steps_per_epoch: int | None) -> int | None:
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


def data_notes(config: Config, data: Data, total_steps: int | None) -> list[str]:
    """What the log says of the validation set, and of a cosine schedule over a stream's unknown length."""
    notes = []
    if data.val is not None:
        notes.append(f"validation: {data.val.num_samples} samples"
                     + (f" held out of the training set (data.val_fraction = {config.data.val_fraction})"
                        if config.data.val_fraction else "") + ", evaluated during training (val_*); the test set "
                     "at the end")
    if total_steps is None and config.train.schedule == "cosine":  # its length given by train.schedule_steps
        notes.append(f"the cosine schedule spans train.schedule_steps = {config.train.schedule_steps} steps; a "
                     "stream's steps are not known ahead, and any past that many train at a learning rate of 0")
    return notes


def opening_lines(recorder: Recorder, config: Config, runtime: Runtime, dims: ParallelDims, plan: BatchPlan,
                  total_steps: int | None, data: Data, notes: list[str]) -> None:
    """The run's first lines: where it runs, the notes gathered while the input was checked, and its batch layout."""
    recorder.info(f"world size {runtime.world_size}, device {runtime.device}, backend {runtime.backend}"
                  + (f", host allocator {allocator.running()}" if runtime.device.type == "cpu" else ""))
    for note in notes:
        recorder.info(note)
    ranks = (f"{runtime.world_size} ranks" if dims.data_parallel == runtime.world_size else
             f"{dims.data_parallel} data-parallel ranks of {runtime.world_size}")
    recorder.info(f"{_steps_said(config, total_steps)} of {plan.global_batch_size} samples ({ranks} x "
                  f"{config.train.grad_accum_steps} micro-steps x {plan.micro_batch_size}), "
                  f"{type(data.train).__name__}")
