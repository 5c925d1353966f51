"""`distrib.fit`: the trainer from Python, for a model and datasets built in the user's own script. The same script
runs as one process (`python train.py`) and unchanged under `torchrun` or `distrib launch`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch.nn as nn

from distrib.config import Config, load_config
from distrib.errors import ConfigError, Preempted, UserError, say

# How long a rank leaves a mistake every rank found to rank 0, to say once, before it says it itself.
RANK_0_WAIT_S = 10.0


def _toml_text(value: Any) -> str:
    """A Python value as the TOML text that --set reads (strings stay plain text for string keys)."""
    from distrib.config import _toml_value

    return value if isinstance(value, str) else _toml_value(value)


def resolve_config(config: str | Path | Config | None, overrides: Mapping[str, Any] | None) -> Config:
    """The built-in defaults, a TOML file or a Config, then {"section.key": value} overrides; checked against its
    strategy's rules too (before any process group: the driver of distrib.integrations.ray starts no worker)."""
    from distrib.distributed.strategies import check_config

    resolved = _resolved(config, overrides)
    check_config(resolved)
    return resolved


def _resolved(config: str | Path | Config | None, overrides: Mapping[str, Any] | None) -> Config:
    items = [f"{key}={_toml_text(value)}" for key, value in (overrides or {}).items()]
    if isinstance(config, Config):
        from distrib.config import to_dict

        return load_config(None, items, base=to_dict(config)) if items else config
    if config is not None and not isinstance(config, (str, Path)):
        raise ConfigError(f"fit(config={type(config).__name__}): give a TOML path, a distrib.Config or None")
    return load_config(str(config) if config is not None else None, items)


def fit(model: nn.Module | Callable[..., nn.Module], train_data, test_data,
        config: str | Path | Config | None = None, overrides: Mapping[str, Any] | None = None,
        loss_fn: Callable | None = None, metrics: Sequence[Callable] = (), collate_fn: Callable | None = None,
        init_from: str | Path | None = None, val_data=None, callbacks: Sequence[Any] = ()) -> dict:
    """Trains `model` on `train_data`, evaluates it exactly on `test_data`; returns the summary (as in summary.json).

    model: an nn.Module, or a function returning one (called after seeding, with num_classes, in_channels and
        image_size from the data if it declares them: the same initial weights at any world size).
    train_data, test_data: map-style datasets (or Python lists) of (inputs, targets) (e.g. torchvision's) or of
        dicts of tensors (a tokenized Hugging Face dataset; the dict goes to model(**batch), its "labels" are the
        targets, kept out of forward when it takes none), or (inputs, targets) pairs of tensors. Inputs and targets
        may be tensors of any dtype and shape, or dicts.
        train_data may be a stream: an IterableDataset, or a Hugging Face streaming dataset (train.epochs counts
        its passes; train.max_steps is needed only by a cosine schedule without train.schedule_steps; see
        docs/data.md, Streams).
    config: a TOML path or a distrib.Config (default: the built-in defaults); overrides: {"train.lr": 0.1, ...}.
    loss_fn: (outputs, targets) -> scalar mean, given the model's outputs whole: a tensor as it is, a dict, tuple or
        ModelOutput as the model returned it; default: the model's own outputs.loss if it returns one, else
        train.loss (cross-entropy). The output's other losses (keys ending in "loss", e.g. a mixture of experts'
        aux_loss) are logged each log step; they join the backward only beside a built-in train.loss when the model
        returns no loss (docs/training-features.md, Experts and extra losses).
    metrics: functions (outputs, targets) -> {name: (sum, count)}, reported as test_<name> = sum / count, summed
        exactly over the whole test set (as metrics.eval does for functions named in the config).
    collate_fn: list of samples -> a batch (a dict of tensors, e.g. a Hugging Face data collator's, or an (inputs,
        targets) pair), for datasets read through the DataLoader; default (and data.collate unset): dict samples of
        ids of different lengths are right-padded in every micro-batch (input_ids with data.pad_id, attention_mask 0,
        labels -100).
    init_from: pretrained weights for the model (model.init_from): a Hugging Face folder or file of safetensors, a
        distrib run directory, or a checkpoint; names and shapes must match the model's, and each rank reads only
        the slices it holds.
    val_data: a validation set, of the kinds train_data may be (or data.val_fraction holds out a share of
        train_data): evaluated during training as val_* (what early stopping and best-k may watch); the test set is
        then evaluated only at the end.
    callbacks: objects with any of the hooks on_train_start(model), on_step_end(step, loss), on_evaluate(step,
        metrics), on_train_end(summary), called on every rank in list order (after train.callbacks'); a hook that
        raises ends the run with one UserError naming it. See distrib.training.callbacks.Callback.

    Run as one process, or unchanged under `torchrun --nproc-per-node N` / `distrib launch`: every worker runs the
    script, fit() joins the process group the launcher set up and takes its share of each global batch. Outputs go
    to run.dir as with `distrib train` (config.toml, metrics.jsonl, summary.json, weights/, model.pt). Called again on a
    finished run.dir it trains nothing, writes nothing and returns that run's summary (one line says so).

    A mistake (in the config, the data, the model) raises one distrib.errors.UserError, which a script may catch.
    Uncaught, it ends the script as `distrib train` ends: one line `distrib: error: ...` and exit code 2
    (EnvironmentFault 74, a lost or hung peer 69), no traceback. Under torchrun the rank that found it says it (rank 0
    alone for a config mistake: every rank finds it); under distrib launch the launcher's last line alone names a
    mistake (exit 2), once for the ranks that share it.

    A stop signal (checkpoint.signals: SIGTERM, SIGUSR1) checkpoints at the next step boundary, says one line and
    raises distrib.Preempted, a SystemExit with code 75: uncaught, the script ends with exit code 75 and no traceback
    (a job script requeues it; the same command resumes). A script that must act on it catches distrib.Preempted
    and re-raises it.

    >>> import torch
    >>> from distrib import fit
    >>> g = torch.Generator().manual_seed(0)
    >>> x, y = torch.randn(512, 1, 8, 8, generator=g), torch.randint(0, 4, (512,), generator=g)
    >>> def model(num_classes, in_channels, image_size):
    ...     return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_channels * image_size ** 2, num_classes))
    >>> summary = fit(model, (x[:384], y[:384]), (x[384:], y[384:]),
    ...               overrides={"train.max_steps": 20, "train.global_batch_size": 64, "run.progress": False,
    ...                          "dist.device": "cpu", "run.dir": "runs/fit-doctest"})
    >>> summary["steps"], summary["test_count"]
    (20, 128)
    """
    from distrib.data import data_from_datasets
    from distrib.distributed.runtime import open_runtime
    from distrib.launch.rundir import environment_faults
    from distrib.worker import peers_lost, train_on

    resolved = None
    try:
        extra = {"model.init_from": str(init_from)} if init_from is not None else {}
        resolved = _without_spawn_if_unguarded(resolve_config(config, {**(overrides or {}), **extra}))
        with environment_faults(), open_runtime(resolved.dist, run_dir=Path(resolved.run.dir)) as runtime, \
                peers_lost(resolved, runtime):
            data = data_from_datasets(train_data, test_data, resolved.data, runtime, resolved.train.seed,
                                      collate_fn=collate_fn, val=val_data)
            # train_on locks the run's folders
            return train_on(resolved, runtime, data=data, model=model, loss_fn=loss_fn, metrics=tuple(metrics),
                            callbacks=tuple(callbacks))
    except Preempted as e:  # a SystemExit(75): uncaught, the script ends with 75 and no traceback
        if e.announce:  # rank 0's: one line for the run, not one per rank
            say(e.line())
        raise
    except Exception as e:
        _record(e)
        if isinstance(e, UserError):  # its one line says it all: not the chain of exceptions that led to it
            _one_line_if_uncaught(e, every_rank=resolved is None)  # the config's: on every rank alike
            raise e.with_traceback(None) from None
        raise


def _without_spawn_if_unguarded(config: Config) -> Config:
    """checkpoint.async_save = process starts a process that runs the script's top level again (multiprocessing's
    spawn): from a script that calls fit() outside its main guard, the thread save instead, said in one line. In
    such a process, fit() is a mistake that ends it at once (a guard this check missed)."""
    import dataclasses

    from distrib.checkpoint.process import GUARD, in_spawned_child, unguarded_script
    from distrib.distributed.runtime import read_launch_env

    if in_spawned_child():
        raise UserError(f"distrib.fit: called in a process that this script's run started (it runs the script's top "
                        f"level again); put the training under `{GUARD}`")
    script = unguarded_script() if config.checkpoint.async_save == "process" else None
    if script is None:
        return config
    if read_launch_env().rank == 0:
        say(f"distrib.fit: warning: checkpoint.async_save = 'process' starts a checkpoint process that runs {script}'s "
            f"top level again, and fit() is called there outside `{GUARD}`; saving in a thread instead "
            "(checkpoint.async_save = 'thread'): put the call under that guard to save in a process")
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, async_save="thread"))


def _record(error: Exception) -> None:
    """Under torchrun or distrib launch (TORCHELASTIC_ERROR_FILE set), the exception's type and message go to torch's
    error file, as @record on an entry point does: the launcher's last line then names them, not just an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(error)


def _one_line_if_uncaught(error: UserError, every_rank: bool) -> None:
    """Should `error` end the script uncaught, it ends it as the CLI ends: one line, then its exit code, no traceback
    on every rank. One that every rank raised alike (a config mistake, found before any process group) is said by
    rank 0 alone (the others say it after RANK_0_WAIT_S, if their launcher has not stopped them by then)."""
    from distrib.distributed.runtime import read_launch_env

    try:
        error._left_to_rank_0 = every_rank and read_launch_env().rank != 0
    except UserError:  # a launch environment fit refused: each rank says so
        error._left_to_rank_0 = False
    if not isinstance(sys.excepthook, _OneLineExit):  # outermost: init_process_group wraps the hook it finds
        sys.excepthook = _OneLineExit(sys.excepthook)


class _OneLineExit:
    """sys.excepthook once fit() raised a distrib error: an uncaught one is `distrib: error: ...` (unless distrib
    launch's last line names it, another survivor of a lost peer does, or rank 0 says it), then the process ends with
    its exit code (2; EnvironmentFault 74, a hung or lost peer 69). Any other exception goes to the hook before it."""

    def __init__(self, previous: Callable) -> None:
        self.previous = previous

    def __call__(self, kind, error, traceback) -> None:
        if not isinstance(error, UserError):
            return self.previous(kind, error, traceback)
        from distrib.errors import hard_exit
        from distrib.launch.reporting import told_elsewhere

        if not told_elsewhere(error):
            if getattr(error, "_left_to_rank_0", False):
                # Ended at once, this rank would have its launcher (torchrun: within 0.1 s) stop rank 0 before rank 0
                # says it; rank 0's end stops this one instead. Still running after the wait, it says it too.
                time.sleep(RANK_0_WAIT_S)
            say(f"distrib: error: {error}")
        if not (sys.flags.interactive or hasattr(sys, "ps1")):  # a Python prompt goes on
            hard_exit(error.exit_code)  # gloo's threads can abort at interpreter exit
