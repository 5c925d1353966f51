"""How a worker builds its model: the config's or distrib.fit's (a module, or a function of the data's sizes), with
SyncBatchNorm if asked, given model.init_from's weights (not read when the run resumes: its checkpoint holds every
weight), and the note its BatchNorm layers call for."""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist
import torch.nn as nn

from distrib.checkpoint.init_from import check_weights, clear_weights, load_weights, open_source
from distrib.checkpoint.resume import resumable
from distrib.config import Config
from distrib.data import Data
from distrib.distributed.parallel import sync_batchnorm, unwrap
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import Build, LoadWeights
from distrib.distributed.strategies.materialise import init_seeded
from distrib.factory import accepted, call_factory
from distrib.launch.rundir import checkpoint_dir
from distrib.models import adapters
from distrib.models.build import batchnorm_layers, build_model, data_kwargs
from distrib.training.preflight import dry_forward
from distrib.training.state import TrainState

ModelArg = nn.Module | Callable[..., nn.Module] | None  # distrib.fit's model: a module, a function, or the config's


def model_build(config: Config, runtime: Runtime, data: Data, model: ModelArg, notes: list[str],
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
                 load_weights=init_from(config, notes, resuming), log=notes.append,
                 dry_forward=dry_forward(data.train))


def init_from(config: Config, notes: list[str], resuming: bool = False) -> LoadWeights | None:
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


def will_resume(config: Config, runtime: Runtime) -> bool:
    """Whether the run will resume (rank 0 looks at checkpoint.dir's names; every rank hears it), decided before the
    model is built only for model.init_from, which is then not read; decided for good under run.dir's lock."""
    if not config.model.init_from:
        return False
    found = [resumable(config.checkpoint.resume, checkpoint_dir(config)) if runtime.is_main else None]
    dist.broadcast_object_list(found, src=0)
    return bool(found[0])


def init_from_after_all(config: Config, state: TrainState, notes: list[str]) -> None:
    """model.init_from into the model of a run that found a checkpoint to resume at start-up but none under the lock
    (each one damaged, beside another run's: checkpoint.foreign = keep): the run starts afresh from the file after
    all, and so does its EMA."""
    init_from(config, notes)(unwrap(state.model))
    if state.ema is not None:
        state.ema.reset()


def model_notes(config: Config, model: nn.Module) -> list[str]:
    """A line on the model's BatchNorm layers, unless dist.sync_batchnorm: why other world sizes no longer agree."""
    norms = batchnorm_layers(model)
    if config.dist.sync_batchnorm or not norms:
        return []
    return [f"the model has {len(norms)} BatchNorm layers ({norms[0]}, ...): their statistics are per micro-batch, "
            "so runs at other world sizes or grad_accum_steps no longer agree exactly; on GPUs, --set "
            "dist.sync_batchnorm=true computes them over each micro-step's global batch (frozen ones: a callback "
            "keeps them in eval mode: docs/training-features.md, Callbacks)"]
