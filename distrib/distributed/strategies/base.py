"""The contract every strategy keeps: how the model is built, materialised and laid out, how a step's forward and
backward run and its gradients sync and clip, how the training state is gathered, loaded and saved.

A strategy holds the run's one ParallelDims (every parallel degree, and the mesh built from them: the data slices,
losses and rank agreement read their coordinates and counts from it). The worker, trainer, checkpoint package,
evaluation and plan talk to this interface only, never to a strategy's name. Each subclass registers the
dist.strategy names it serves (`names`) and checks the config's rules about its state (`check`; the degrees'
keys: distrib.distributed.dimensions)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn as nn

from distrib.config import Config, DistConfig, SpeedConfig
from distrib.distributed import pipeline
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import clip_grad_norm
from distrib.distributed.runner import Runner
from distrib.distributed.runtime import Runtime
from distrib.distributed.unused import DryForward
from distrib.errors import ConfigError, UserError

# Loads weights into the built, materialised (possibly sharded) model in place of its initialisation: the hook that
# model.init_from uses (each rank loads its own slices of a sharded model). None: the model's own initialisation.
LoadWeights = Callable[[nn.Module], None]


@dataclass(frozen=True, slots=True)
class Build:
    """How to build the model: `factory` makes it (the config's model or distrib.fit's, SyncBatchNorm included) on
    whatever device torch's default says (a strategy calls it under torch.device("meta") to build without memory);
    `seed` is train.seed, set before the factory and before a self-initialising model's init; `speed` and
    `precision` the [speed] options and train.precision the wrapping applies; `given`: a module that exists already
    (given to distrib.fit), used as it is; `load_weights` see LoadWeights; `log` takes lines for the run's log;
    `dry_forward(model)` runs the model on the first batch's inputs (the probe of dist.find_unused_parameters = auto:
    distrib.distributed.unused; None: no probe)."""

    factory: Callable[[], nn.Module]
    seed: int
    speed: SpeedConfig = SpeedConfig()
    precision: str = "fp32"
    given: nn.Module | None = None
    load_weights: LoadWeights | None = None
    log: Callable[[str], None] = print
    dry_forward: DryForward | None = None


@dataclass(frozen=True, slots=True)
class StepLoss:
    """What the trainer gives a strategy to run one optimizer step: `loss(outputs, targets, pieces)` is the loss to
    backward for one of `pieces` equal pieces of a micro-batch, normalised once for the whole step (the one place,
    distrib.training.losses.step_loss); `forward(model, inputs)` runs the model on a batch's inputs; `autocast()`
    the precision's context; `backward(loss)` the (scaled) backward; `batch(inputs, targets)` the tensors a device
    mismatch lists."""

    loss: Callable[[object, object, int], torch.Tensor]
    forward: Callable[[nn.Module, object], object]
    autocast: Callable[[], contextlib.AbstractContextManager]
    backward: Callable[[torch.Tensor], None]
    batch: Callable[[object, object], dict]
    device: torch.device


# dist.strategy -> the class that serves it, filled by each subclass's `names` as it is defined.
_REGISTERED: dict[str, type[Strategy]] = {}


def registered() -> dict[str, type[Strategy]]:
    """{dist.strategy name: its class}, in the order the classes were defined."""
    return dict(_REGISTERED)


def strategy_named(name: str) -> type[Strategy]:
    """The class that serves dist.strategy = name, or a one-line ConfigError listing the names registered."""
    if name not in _REGISTERED:
        raise ConfigError(f"dist.strategy = {name!r}: no strategy registers that name; use one of "
                          f"{', '.join(_REGISTERED)}, e.g. --set dist.strategy=ddp")
    return _REGISTERED[name]


class Strategy(ABC):
    """How a layout's state is held: whole on every data-parallel rank (distrib.distributed.strategies.ddp) or in
    shards (.fsdp: fsdp and hsdp, and every pipeline). The degrees themselves are the mesh's (ParallelDims) and are
    applied by the one parallelize (distrib.distributed.parallelize); a strategy differs only where its state does."""

    # The dist.strategy values this class serves, registered when the class is defined (each name once). config.py
    # lists the same names as dist.strategy's choices, for its docs; tests/unit/test_strategies.py keeps the two equal.
    names: ClassVar[tuple[str, ...]] = ()
    # Whether the training state is DTensor shards (each rank saves its own: DCP checkpoints) or whole on every rank
    # (one file, written by rank 0).
    sharded_state: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("names", ()):  # its own names only: a subclass does not inherit its parent's
            assert name not in _REGISTERED, f"dist.strategy {name!r} registered by {_REGISTERED[name].__name__} too"
            _REGISTERED[name] = cls

    def __init__(self, config: DistConfig, dims: ParallelDims):
        self.config, self.dims = config, dims
        # How a step runs on this rank's model (the plain step, or a pipeline's schedule), chosen once: the model's
        # layout, its step, its gradient norm and its gathered state ask it (distrib.distributed.runner).
        self.runner: Runner = pipeline.runner_for(config, dims)

    # ---------------------------------------------------------------- the config's rules and the mesh

    @classmethod
    def check(cls, config: Config) -> None:
        """A one-line ConfigError (key, value, fix) for what this strategy's state cannot hold (the dist keys'
        rules are the degrees': distrib.distributed.dimensions). Called before any worker starts (distrib train,
        plan, fit: strategies.check_config)."""
        if cls.sharded_state and config.train.precision == "fp16":  # GradScaler would skip per shard
            raise ConfigError(f"train.precision = 'fp16': not supported with {cls.described(config.dist)} (a "
                              "GradScaler's skip decision would differ between shards); use --set train.precision=bf16")
        if config.checkpoint.async_save != "off" and not cls.sharded_state:
            raise ConfigError(f"checkpoint.async_save = '{config.checkpoint.async_save}': background saves write "
                              "sharded (fsdp, hsdp) checkpoints; set --set dist.strategy=fsdp or "
                              "--set checkpoint.async_save=off")

    @classmethod
    def described(cls, config: DistConfig) -> str:
        """The config's words for this layout in a refusal."""
        return "dist.pipeline_parallel > 1" if config.pipeline_parallel > 1 else f"dist.strategy = '{config.strategy}'"

    @classmethod
    @abstractmethod
    def replicas_and_shards(cls, config: DistConfig, data_parallel: int, world_size: int,
                            local_world_size: int) -> tuple[int, int]:
        """How this strategy lays out the data_parallel ranks: (replicas, ranks per shard group), their product
        data_parallel; or a one-line ConfigError when the config's sizes do not tile them."""

    # ---------------------------------------------------------------- the model's life

    @abstractmethod
    def setup_module(self, build: Build, runtime: Runtime) -> nn.Module:
        """The model built from `build`, its weights initialised (or loaded by build.load_weights) identically at
        every world size, on this worker's device, wrapped and compiled: ready for the optimizer."""

    @abstractmethod
    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Wraps the whole forward AND backward of a micro-step; enabled only in the last one of a step."""

    def forward_backward(self, model: nn.Module, micro_batches: list, step: StepLoss) -> torch.Tensor:
        """The forward and backward of one optimizer step's micro-batches, gradients synced in the last (grad_sync);
        returns this rank's share of the step's loss (the sum of what it backwarded). The runner's: the plain step, or
        a pipeline's schedule."""
        return self.runner.forward_backward(model, micro_batches, step, self.grad_sync)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Scales the gradients to a total norm of at most max_norm, the norm of every parameter of the model (on
        every rank that holds a part of it); returns the norm."""
        return clip_grad_norm(model.parameters(), max_norm, across=self.runner.norm_group)

    def whole_on_rank0(self, state: dict) -> dict:
        """A state_dict made whole on each rank that holds a part (full_model_state's, an EMA's) as rank 0's: the
        same under every strategy but pipeline parallel, whose stages send theirs to rank 0. A collective."""
        return self.runner.whole_on_rank0(state)

    def complete(self, model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's tensors (model_tensors, an EMA's) under every name of the whole model, as the weights files
        lay them out on every rank: as they are, but under pipeline parallel (the other stages' as meta tensors)."""
        return self.runner.complete(tensors)

    def check_micro_batch(self, micro_batch_size: int) -> None:
        """A one-line ConfigError if the strategy cannot run micro-batches of this size (pipeline parallel cuts each
        into microbatches)."""
        self.runner.check_micro_batch(micro_batch_size)

    @property
    def logs_extra_losses(self) -> bool:
        """Whether the trainer's loss sees each micro-batch's outputs whole, so that the model's extra losses are
        logged (not under pipeline parallel, whose last stage sees its microbatches' outputs only)."""
        return self.runner.logs_extra_losses

    @property
    def loss_ranks(self) -> int:
        """How many ranks hold the loss of a step (the rank agreement's sum is divided by it)."""
        return self.dims.loss_ranks

    def after_forward_only(self, model: nn.Module) -> None:
        """After forwards without a backward (the pre-flight checks, an evaluation): the model back on the tensors
        its optimizer holds and its checkpoint saves. Nothing to do unless a strategy gathers parameters."""

    @abstractmethod
    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, named: bool = False) -> dict:
        """{"model", "optimizer"} as this strategy checkpoints them (no module. or _orig_mod. prefixes). named: the
        optimizer keyed by parameter names (the view a sharded checkpoint is loaded into)."""

    @abstractmethod
    def load_training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Any strategy's saved state (one file: whole tensors; DCP: resharded to this model) into this model."""

    @abstractmethod
    def full_model_state(self, model: nn.Module) -> dict:
        """What model.pt holds: the whole plain state_dict on rank 0 (a collective where the model is sharded; the
        other ranks may get {})."""

    def setup_trained(self, model: nn.Module, runtime: Runtime, speed: SpeedConfig) -> nn.Module:
        """A whole trained model (its weights loaded, on the host) placed and wrapped on this worker as training
        wrapped it, for distrib eval and predict: each rank runs its own batches of it. Only strategies that keep the
        model whole on every rank can; distrib.distributed.strategies.for_trained picks one."""
        raise UserError(f"{type(self).__name__} shards the model, and evaluating a trained model runs it whole on "
                        "every rank; evaluate it under --set dist.strategy=ddp")

    # ---------------------------------------------------------------- distrib plan

    def plan_module(self, model: nn.Module, runtime: Runtime, precision: str,
                    speed: SpeedConfig = SpeedConfig()) -> nn.Module:
        """The meta-device model as each rank of this strategy holds it (sharded by the run's own calls)."""
        return model

    @property
    def state_on_host(self) -> bool:
        """Whether the parameter, gradient and optimizer state lives in host memory (dist.cpu_offload)."""
        return False
