"""The run's configuration: typed, frozen sections validated on construction, loaded from TOML plus dotted overrides.

Imports nothing heavy (no torch): the CLI and the launcher read configs before any worker exists."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import re
import signal
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from distrib.errors import ConfigError

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _fail(section: str, key: str, value, why: str, fix: str) -> typing.NoReturn:
    raise ConfigError(f"{section}.{key} = {value!r}: {why}; {fix}")


def _choice(section: str, obj, key: str, allowed: tuple[str, ...]) -> None:
    value = getattr(obj, key)
    if value not in allowed:
        _fail(section, key, value, f"must be one of {', '.join(allowed)}",
              f"e.g. --set {section}.{key}={allowed[0]}")


def _at_least(section: str, obj, key: str, low: float) -> None:
    value = getattr(obj, key)
    if not (math.isfinite(value) and value >= low):
        _fail(section, key, value, f"must be a finite number >= {low}", f"set {section}.{key} to {low} or more")


def _positive(section: str, obj, key: str, example) -> None:
    value = getattr(obj, key)
    if not (math.isfinite(value) and value > 0):
        _fail(section, key, value, "must be a finite number > 0", f"e.g. --set {section}.{key}={example}")


LOSSES = ("cross_entropy", "mse", "l1", "bce_with_logits")
OPTIMIZERS = ("sgd", "adam", "adamw")

# What early stopping and best-k checkpoints can watch: lower is better for losses, higher for accuracies.
EVAL_METRICS = ("test_loss", "test_accuracy", "test_loss_ema", "test_accuracy_ema", "val_loss", "val_accuracy",
                "val_loss_ema", "val_accuracy_ema")  # val_*: with a validation set (data.val_fraction, ...)


def _needs_ema(section: str, key: str, value: str, ema_decay: float) -> None:
    if value.endswith("_ema") and not ema_decay:
        _fail(section, key, value, "watches the EMA weights, and train.ema_decay = 0 keeps none",
              "e.g. --set train.ema_decay=0.999")


@dataclass(kw_only=True, frozen=True, slots=True)
class DataConfig:
    name: str = "fashion-mnist"  # fashion-mnist | mnist | cifar10 | imagefolder | synthetic | text | tokens
    root: str = "data"  # the user's dataset folder (text: a file or folder of .txt): read; downloads go under it
    factory: str = ""  # package.module:function returning (train, test) datasets; overrides name
    kwargs: dict = field(default_factory=dict)  # keyword arguments of the factory
    loader: str = "auto"  # auto (device-resident when in memory and it fits) | device | dataloader
    num_workers: int = 0  # DataLoader worker processes (dataloader path only)
    pin_memory: bool = True  # DataLoader: page-locked host batches (accelerators only)
    persistent_workers: bool = True  # DataLoader: keep the worker processes between epochs (num_workers > 0)
    prefetch_factor: int = 2  # DataLoader: batches each worker loads ahead (num_workers > 0)
    image_size: int = 0  # imagefolder: resize every image to image_size x image_size; 0 = as stored
    normalize: str | tuple[tuple[float, ...], ...] = "auto"  # auto | none | [[means], [stds]] (per channel, 0..1)
    augment: str = "none"  # none | flip | crop_flip (training only; keyed by seed, epoch and sample index)
    crop_padding: int = 4  # crop_flip: zero padding on each side before the random crop
    num_classes: int = 0  # synthetic: number of classes (0 = 10); others: 0 = from the data
    synthetic_shape: tuple[int, ...] = (1, 28, 28)  # synthetic: (C, H, W) of one sample
    eval_batch_size: int = 1000
    synthetic_train_size: int = 8192
    synthetic_test_size: int = 1000
    seq_len: int = 256  # text | tokens: tokens per training window (the model's context)
    test_fraction: float = 0.1  # text: the last share of the bytes, held out for evaluation
    val_fraction: float = 0.0  # the share of the training samples held out for validation (val_*); 0 = none
    vocab_size: int = 0  # tokens: the vocabulary size (token ids < vocab_size); text is bytes: 256
    collate: str = ""  # package.module:function making a micro-batch of a list of samples; "" = distrib's padding
    pad_id: int = 0  # the input_ids of padding, when distrib pads dict samples of different lengths
    pad: str = "auto"  # auto (dict samples' 1-D ids padded when the data's first samples differ in length) | always
    train_files: str = ""  # tokens: a glob of token shards (raw uint16 or llm.c's); "" = data.root/train.bin
    test_files: str = ""  # tokens: a glob of held-out token shards; "" = data.root/val.bin

    def __post_init__(self):
        if self.factory:
            if not _FACTORY.match(self.factory):
                _fail("data", "factory", self.factory, "must look like package.module:function",
                      "e.g. --set data.factory=mypkg.data:build")
        else:
            _choice("data", self, "name", ("fashion-mnist", "mnist", "cifar10", "imagefolder", "synthetic", "text",
                                           "tokens"))
        _choice("data", self, "loader", ("auto", "device", "dataloader"))
        _choice("data", self, "augment", ("none", "flip", "crop_flip"))
        _choice("data", self, "pad", ("auto", "always"))
        if not self.root:
            _fail("data", "root", self.root, "must not be empty", "e.g. --set data.root=data")
        if self.collate and not _FACTORY.match(self.collate):
            _fail("data", "collate", self.collate, "must look like package.module:function",
                  "e.g. --set data.collate=mypkg.data:collate")
        for key in ("num_workers", "image_size", "crop_padding", "num_classes", "pad_id"):
            _at_least("data", self, key, 0)
        for key in ("prefetch_factor", "eval_batch_size", "synthetic_train_size", "synthetic_test_size"):
            _at_least("data", self, key, 1)
        if len(self.synthetic_shape) != 3 or min(self.synthetic_shape) < 1:
            _fail("data", "synthetic_shape", list(self.synthetic_shape), "must be [C, H, W] of positive sizes",
                  "e.g. --set data.synthetic_shape=[3,32,32]")
        self._check_normalize()
        self._check_tokens()

    def _check_tokens(self):
        _at_least("data", self, "seq_len", 1)
        if not (0.0 <= self.val_fraction < 1.0):
            _fail("data", "val_fraction", self.val_fraction, "must be in [0, 1)", "e.g. --set data.val_fraction=0.1")
        if not (0.0 < self.test_fraction < 1.0):
            _fail("data", "test_fraction", self.test_fraction, "must be in (0, 1)",
                  "e.g. --set data.test_fraction=0.1")
        if not (0 <= self.vocab_size <= 65536):
            _fail("data", "vocab_size", self.vocab_size, "must be in [0, 65536] (token ids are uint16)",
                  "e.g. --set data.vocab_size=50304")
        if self.name == "tokens" and not self.factory and self.vocab_size < 1:
            _fail("data", "vocab_size", self.vocab_size, "data.name = tokens needs the vocabulary size of its "
                  "train.bin and val.bin", "e.g. --set data.vocab_size=50304 (GPT-2's, padded)")
        for key, other in (("train_files", "test_files"), ("test_files", "train_files")):
            if getattr(self, key) and (self.name != "tokens" or self.factory):
                _fail("data", key, getattr(self, key), "names token shards, read only by data.name = tokens",
                      f"--set data.name=tokens, or leave data.{key} empty")
            if getattr(self, key) and not getattr(self, other):
                _fail("data", other, "", f"data.{key} is set, so the other split's shards are needed too",
                      f"e.g. --set 'data.{other}=data/fineweb10B/fineweb_{other[:-6].replace('test', 'val')}_*.bin'")

    def _check_normalize(self):
        value = self.normalize
        if isinstance(value, str):
            if value not in ("auto", "none"):
                _fail("data", "normalize", value, "must be auto, none or [[means], [stds]]",
                      "e.g. --set data.normalize=auto")
            return
        ok = len(value) == 2 and len(value[0]) == len(value[1]) >= 1
        if not ok or not all(math.isfinite(v) for row in value for v in row) or min(value[1]) <= 0:
            _fail("data", "normalize", [list(row) for row in value],
                  "must be [[means], [stds]]: two lists of one number per channel, stds > 0",
                  "e.g. --set 'data.normalize=[[0.5,0.5,0.5],[0.25,0.25,0.25]]'")


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelConfig:
    name: str = "network"  # network: the seed Fashion-MNIST CNN | gpt: the built-in decoder-only transformer
    factory: str = ""  # package.module:function returning any nn.Module; overrides name
    kwargs: dict = field(default_factory=dict)  # keyword arguments of the factory (besides num_classes, ...)
    init_from: str = ""  # pretrained weights read into the built model: safetensors, a run's weights, a checkpoint

    def __post_init__(self):
        if self.factory:
            if not _FACTORY.match(self.factory):
                _fail("model", "factory", self.factory, "must look like package.module:function",
                      "e.g. --set model.factory=mypkg.models:build")
        else:
            _choice("model", self, "name", ("network", "gpt"))


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainConfig:
    epochs: int = 12  # 0 = bounded by max_steps only
    max_steps: int = 0  # optimizer steps; 0 = no limit
    global_batch_size: int = 128  # samples per optimizer step, summed over ranks and micro-steps
    grad_accum_steps: int = 1
    lr: float = 0.05
    optimizer: str = "sgd"  # sgd | adam | adamw | package.module:function, (parameter groups, config) -> Optimizer
    momentum: float = 0.9  # sgd only
    betas: tuple[float, ...] = (0.9, 0.999)  # adam, adamw: the moving averages' coefficients
    weight_decay: float = 0.0
    decay: str = "weights"  # adam, adamw: weights (no weight decay on biases, norms, embeddings) | all
    schedule: str = "cosine"  # constant | cosine (with linear warm-up)
    schedule_steps: int = 0  # the schedule's length in steps; 0 = this run's total (fix it if the run may be extended)
    warmup_steps: int = 100
    grad_clip: float = 0.0  # max global grad norm; 0 = off
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses a GradScaler)
    log_every: int = 50  # optimizer steps between log lines (each log line syncs with the host)
    eval_every_epochs: int = 1  # 0 = evaluate only at the end
    finite_check_every: int = 1  # steps between checks that the reduced gradients are finite; 0 = never
    sync_every: int = 10  # steps between the ranks' all-reduce of (loss, stop votes); log steps always sync
    early_stop_metric: str = ""  # "" = off | test_loss | test_accuracy | ..._ema | val_loss ... (a validation set)
    early_stop_patience: int = 3  # evaluations without improvement before every rank stops
    early_stop_min_delta: float = 0.0  # an improvement must exceed this to reset the patience
    ema_decay: float = 0.0  # exponential moving average of the weights, updated every step; 0 = off
    loss: str = "cross_entropy"  # cross_entropy | mse | l1 | bce_with_logits | package.module:function (a model's
    # own outputs.loss wins over it)
    label_smoothing: float = 0.0  # cross_entropy only
    callbacks: tuple[str, ...] = ()  # package.module:Class each, called with no arguments (distrib.training.callbacks)

    def __post_init__(self):
        if self.loss not in LOSSES and not _FACTORY.match(self.loss):
            _fail("train", "loss", self.loss, f"must be {', '.join(LOSSES)} or package.module:function",
                  "e.g. --set train.loss=mypkg.losses:focal")
        if self.optimizer not in OPTIMIZERS and not _FACTORY.match(self.optimizer):
            _fail("train", "optimizer", self.optimizer, f"must be {', '.join(OPTIMIZERS)} or package.module:function",
                  "e.g. --set train.optimizer=adamw")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _fail("train", "betas", list(self.betas), "must be two numbers in [0, 1)",
                  "e.g. --set train.betas=[0.9,0.95]")
        _choice("train", self, "decay", ("weights", "all"))
        for spec in self.callbacks:
            if not _FACTORY.match(spec):
                _fail("train", "callbacks", list(self.callbacks), f"{spec!r} must look like package.module:Class",
                      'e.g. --set train.callbacks=["mypkg.callbacks:FreezeBatchNorm"]')
        if not (0.0 <= self.label_smoothing < 1.0):
            _fail("train", "label_smoothing", self.label_smoothing, "must be in [0, 1)",
                  "e.g. --set train.label_smoothing=0.1")
        for key in ("epochs", "max_steps", "warmup_steps", "seed", "eval_every_epochs", "finite_check_every",
                    "schedule_steps"):
            _at_least("train", self, key, 0)
        for key in ("global_batch_size", "grad_accum_steps", "log_every", "sync_every"):
            _at_least("train", self, key, 1)
        if self.epochs == 0 and self.max_steps == 0:
            _fail("train", "epochs", 0, "and train.max_steps = 0 leave the run unbounded",
                  "set --set train.epochs=1 or --set train.max_steps=100")
        _positive("train", self, "lr", 0.01)
        _choice("train", self, "schedule", ("constant", "cosine"))
        _choice("train", self, "precision", ("fp32", "bf16", "fp16"))
        _at_least("train", self, "weight_decay", 0.0)
        _at_least("train", self, "grad_clip", 0.0)
        if not (0.0 <= self.momentum < 1.0):
            _fail("train", "momentum", self.momentum, "must be in [0, 1)", "e.g. --set train.momentum=0.9")
        if not (0.0 <= self.ema_decay < 1.0):
            _fail("train", "ema_decay", self.ema_decay, "must be in [0, 1)", "e.g. --set train.ema_decay=0.999")
        _choice("train", self, "early_stop_metric", EVAL_METRICS + ("",))
        _at_least("train", self, "early_stop_patience", 1)
        _at_least("train", self, "early_stop_min_delta", 0.0)
        _needs_ema("train", "early_stop_metric", self.early_stop_metric, self.ema_decay)
        if self.early_stop_metric and not self.eval_every_epochs:
            _fail("train", "early_stop_metric", self.early_stop_metric, "needs evaluations during training, and "
                  "train.eval_every_epochs = 0", "--set train.eval_every_epochs=1")


@dataclass(kw_only=True, frozen=True, slots=True)
class RunConfig:
    dir: str = "runs/default"  # config, metrics, summary and model are written here
    progress: bool | str = "auto"  # tqdm bar on rank 0: auto (only when stderr is a terminal) | true | false

    def __post_init__(self):
        if not self.dir:
            _fail("run", "dir", self.dir, "must not be empty", "e.g. --set run.dir=runs/exp1")
        if isinstance(self.progress, str) and self.progress != "auto":
            _fail("run", "progress", self.progress, "must be auto, true or false", "e.g. --set run.progress=auto")


@dataclass(kw_only=True, frozen=True, slots=True)
class DistConfig:
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda
    timeout_s: float = 60.0  # a collective that waits longer fails, naming the ranks it waited for, instead of hanging
    strategy: str = "ddp"  # ddp (a whole replica per rank) | fsdp (FSDP2: parameters, gradients, optimizer sharded)
    # | hsdp (FSDP2 on a 2-D mesh: sharded within groups of dist.shard_size ranks, replicated across them)
    shard_size: int = 0  # hsdp: ranks per shard group; 0 = one node's (LOCAL_WORLD_SIZE / dist.tensor_parallel)
    tensor_parallel: int = 1  # ranks that split each layer of the built-in GPT (innermost mesh dim); fsdp/hsdp outside
    shard_modules: str | tuple[str, ...] = "auto"  # fsdp units (and checkpointed blocks): class names, or auto
    reshard_after_forward: bool = True  # fsdp: free gathered parameters after forward (less memory, one more gather)
    cpu_offload: bool = False  # fsdp: keep parameter, gradient and optimizer shards in host memory
    sync_batchnorm: bool = False  # BatchNorm statistics over the global batch (torch's SyncBatchNorm; GPUs only)

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer state split over ranks (FSDP2 DTensors): fsdp and hsdp."""
        return self.strategy in ("fsdp", "hsdp")

    def __post_init__(self):
        _choice("dist", self, "device", ("auto", "cpu", "cuda"))
        _positive("dist", self, "timeout_s", 60)
        _choice("dist", self, "strategy", ("ddp", "fsdp", "hsdp"))
        names = (self.shard_modules,) if isinstance(self.shard_modules, str) else self.shard_modules
        if not names or not all(isinstance(n, str) and n.isidentifier() for n in names):
            _fail("dist", "shard_modules", self.shard_modules, "must be auto or a list of module class names",
                  "e.g. --set 'dist.shard_modules=[\"TransformerBlock\"]'")
        if self.cpu_offload and not self.sharded:
            _fail("dist", "cpu_offload", self.cpu_offload, "offloads FSDP shards, and dist.strategy is ddp",
                  "set --set dist.strategy=fsdp or --set dist.cpu_offload=false")
        _at_least("dist", self, "shard_size", 0)
        if self.shard_size and self.strategy != "hsdp":
            _fail("dist", "shard_size", self.shard_size, f"sizes hsdp's shard groups, and dist.strategy is "
                  f"{self.strategy}", "set --set dist.strategy=hsdp or --set dist.shard_size=0")
        _at_least("dist", self, "tensor_parallel", 1)
        if self.tensor_parallel > 1 and not self.sharded:
            _fail("dist", "tensor_parallel", self.tensor_parallel, "composes with fsdp or hsdp on the data-parallel "
                  "ranks, and dist.strategy is ddp", "set --set dist.strategy=fsdp (or hsdp)")


@dataclass(kw_only=True, frozen=True, slots=True)
class CheckpointConfig:
    dir: str = ""  # "" = RUN_DIR/checkpoints
    every_steps: int = 500  # optimizer steps between checkpoints; 0 = only at the end (and on preemption)
    resume: str = "auto"  # auto (the newest good checkpoint in dir, if any) | never | a checkpoint path
    keep_last: int = 2
    signals: str = "SIGTERM,SIGUSR1"  # checkpoint and exit 75 on these (SLURM: #SBATCH --signal)
    allow_config_change: bool = False  # resume even if model, data or global batch differ from the checkpoint's
    async_save: bool = False  # fsdp: write sharded checkpoints in the background (dcp.async_save); the TOML key is
    # async_save, not async: a Python keyword cannot name a dataclass field
    keep_best: int = 0  # also keep the k best evaluations' checkpoints as best_STEP.pt (never pruned); 0 = off
    best_metric: str = "test_loss"  # what keep_best ranks by: test_loss | test_accuracy | ..._ema | val_loss ...
    foreign: str = "refuse"  # refuse | keep: a new run in a dir holding another run's checkpoints (kept, never pruned)

    def __post_init__(self):
        _at_least("checkpoint", self, "every_steps", 0)
        for name in filter(None, (part.strip().upper() for part in self.signals.split(","))):
            if (name if name.startswith("SIG") else f"SIG{name}") not in signal.Signals.__members__:
                _fail("checkpoint", "signals", self.signals, f"{name} is not a signal",
                      "e.g. --set checkpoint.signals=SIGTERM,SIGUSR1")
            if name.removeprefix("SIG") in ("KILL", "STOP"):
                _fail("checkpoint", "signals", self.signals, f"{name} cannot be caught, so no checkpoint can follow it",
                      "e.g. --set checkpoint.signals=SIGTERM,SIGUSR1")
        if self.keep_last < 1:  # 1 is safe: a new checkpoint is in place before the previous one is pruned
            _fail("checkpoint", "keep_last", self.keep_last, "must be >= 1 (the newest checkpoint is always kept)",
                  "e.g. --set checkpoint.keep_last=2")
        _choice("checkpoint", self, "foreign", ("refuse", "keep"))
        if not self.resume:
            _fail("checkpoint", "resume", self.resume, "must be auto, never or a path",
                  "e.g. --set checkpoint.resume=auto")
        _at_least("checkpoint", self, "keep_best", 0)
        _choice("checkpoint", self, "best_metric", EVAL_METRICS)


@dataclass(kw_only=True, frozen=True, slots=True)
class SpeedConfig:
    compile: bool = False  # torch.compile the DDP model; its warm-up steps stay out of the throughput figures
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    channels_last: bool = False  # NHWC weights and 4-D inputs (faster convolutions on tensor cores)
    gradient_as_bucket_view: bool = False  # DDP: gradients are views into its all-reduce buckets (one copy less)
    static_graph: bool = False  # DDP: the same parameters get gradients every step (lets DDP skip some checks)
    bucket_cap_mb: float = 0.0  # DDP: gradient bucket size in MB; 0 = DDP's default (25, and a 1 MB first bucket)
    activation_checkpointing: str = "none"  # none | blocks: recompute each dist.shard_modules block in backward

    def __post_init__(self):
        _choice("speed", self, "compile_mode", ("default", "reduce-overhead", "max-autotune",
                                                "max-autotune-no-cudagraphs"))
        _choice("speed", self, "activation_checkpointing", ("none", "blocks"))
        _at_least("speed", self, "bucket_cap_mb", 0.0)


LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(kw_only=True, frozen=True, slots=True)
class MetricsConfig:
    loggers: tuple[str, ...] = ("jsonl",)  # jsonl (always on) | tensorboard | wandb | mlflow; rank 0 only
    tensorboard: bool = False  # the same as naming tensorboard in loggers (run.dir/tensorboard)
    project: str = "distrib"  # the W&B project / MLflow experiment
    run_name: str = ""  # the tracker run's name; "" = the name of run.dir
    tags: tuple[str, ...] = ()  # W&B tags / MLflow tags
    mlflow_uri: str = ""  # http://host:5000 or file:/path; "" = MLFLOW_TRACKING_URI if set, else file:RUN_DIR/mlruns
    logger_errors: str = "fail"  # a tracker that cannot start: fail (exit 2 before training) | warn (go on without)
    peak_flops: float = 0.0  # peak FLOP/s of one device for MFU; 0 = from distrib.throughput's table
    timing_skip_steps: int = 5  # first optimizer steps left out of samples/s (compile and warm-up)
    eval: tuple[str, ...] = ()  # the user's metrics, package.module:function: (outputs, targets) -> {name: (sum, n)}

    def __post_init__(self):
        for spec in self.eval:
            if not _FACTORY.match(spec):
                _fail("metrics", "eval", list(self.eval), f"{spec!r} must look like package.module:function",
                      'e.g. --set metrics.eval=["mypkg.metrics:r2"]')
        _at_least("metrics", self, "peak_flops", 0.0)
        _at_least("metrics", self, "timing_skip_steps", 0)
        for name in self.loggers:
            if name not in LOGGERS:
                _fail("metrics", "loggers", list(self.loggers), f"{name!r} is not a logger; allowed: "
                      f"{', '.join(LOGGERS)}", 'e.g. --set metrics.loggers=["jsonl","tensorboard"]')
        if len(set(self.loggers)) != len(self.loggers):
            _fail("metrics", "loggers", list(self.loggers), "names a logger twice", "name each once")
        _choice("metrics", self, "logger_errors", ("fail", "warn"))
        if not self.project:
            _fail("metrics", "project", self.project, "must not be empty", "e.g. --set metrics.project=mnist")


@dataclass(kw_only=True, frozen=True, slots=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self):
        if self.speed.static_graph and self.train.grad_accum_steps > 1:  # DDP's reducer asserts in no_sync steps
            raise ConfigError(f"speed.static_graph = true: does not work with train.grad_accum_steps = "
                              f"{self.train.grad_accum_steps} (DDP's static graph has no no_sync); "
                              "set --set speed.static_graph=false or --set train.grad_accum_steps=1")
        if self.dist.sharded and self.train.precision == "fp16":  # GradScaler would skip per shard
            raise ConfigError(f"train.precision = 'fp16': not supported with dist.strategy = '{self.dist.strategy}' "
                              "(a GradScaler's skip decision would differ between shards); use --set "
                              "train.precision=bf16")
        if self.checkpoint.async_save and not self.dist.sharded:
            raise ConfigError("checkpoint.async_save = true: asynchronous saves write sharded (fsdp) checkpoints; "
                              "set --set dist.strategy=fsdp or --set checkpoint.async_save=false")
        _needs_ema("checkpoint", "best_metric", self.checkpoint.best_metric if self.checkpoint.keep_best else "",
                   self.train.ema_decay)


def check_world_size(global_batch_size: int, grad_accum_steps: int, world_size: int) -> None:
    """train.global_batch_size splits into world_size x train.grad_accum_steps equal micro-batches: checked by each
    worker's batch plan, and by the launcher before any worker starts."""
    parts = world_size * grad_accum_steps
    if global_batch_size % parts:
        low = global_batch_size // parts * parts or parts
        raise ConfigError(f"train.global_batch_size = {global_batch_size}: must divide into world_size "
                          f"({world_size}) x train.grad_accum_steps ({grad_accum_steps}) = {parts} equal "
                          f"micro-batches; use {low} or {low + parts}")


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(options)}"


def _coerce(section: str, key: str, value, hint, raw: str | None):
    """Turns a TOML or CLI value into the field's type, or fails naming the key. Lists become tuples (the sections
    are frozen), tables become dicts; `str | tuple[...]` takes whichever fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in sorted(args, key=lambda a: a is str):  # str last: it takes any CLI text
            with contextlib.suppress(ConfigError):
                return _coerce(section, key, value, option, None if option is not str else raw)
        _fail(section, key, value, f"must be one of the types {' | '.join(_type_name(a) for a in args)}",
              f"give {section}.{key} one of those")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            _fail(section, key, value, "must be a list", f"e.g. --set {section}.{key}=[1,2]")
        item = args[0] if args else typing.Any
        return tuple(value if item is typing.Any else _coerce(section, key, v, item, None) for v in value)
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            _fail(section, key, value, "must be a table", f"e.g. --set '{section}.{key}={{depth = 18}}'")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is str and raw is not None and not isinstance(value, str):
        return raw  # --set data.root=123 means the string "123"
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        _fail(section, key, value, f"must be of type {_type_name(hint)}", f"give {section}.{key} a {_type_name(hint)}")
    return value


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint)


def _build_section(name: str, values: dict, raws: dict):
    cls = _sections()[name]
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{name}.{key}: unknown key; {_suggest(key, hints)}")
        kwargs[key] = _coerce(name, key, value, hints[key], raws.get(key))
    return cls(**kwargs)


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply_override(tree: dict, raws: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ConfigError(f"--set {item!r}: expected section.key=value; e.g. --set train.lr=0.01")
    if section not in _sections():
        raise ConfigError(f"--set {item!r}: unknown section {section!r}; {_suggest(section, _sections())}")
    tree.setdefault(section, {})[name] = _parse_value(text.strip())
    raws.setdefault(section, {})[name] = text.strip()


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r}: no such file; "
                          "give the path of a TOML file such as configs/debug_cpu.toml")
    except IsADirectoryError:
        raise ConfigError(f"--config {path!r}: is a folder, not a file; give the path of a TOML file "
                          "such as configs/debug_cpu.toml") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path!r}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                          "give a TOML file saved as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"--config {path!r}: cannot be read ({e.strerror}); fix its permissions or give "
                          "another file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path!r}: not valid TOML ({e}); fix the file") from None


def load_config(path: str | None = None, overrides: typing.Sequence[str] = (), base: dict | None = None) -> Config:
    """Built-in defaults, then the TOML file (or `base`, a stored config such as a checkpoint's), then each
    --set section.key=value in order."""
    tree = _read_toml(path) if path else {name: dict(values) for name, values in (base or {}).items()}
    raws: dict[str, dict] = {}
    for item in overrides:
        _apply_override(tree, raws, item)
    sections = {}
    for name, values in tree.items():
        if name not in _sections():
            raise ConfigError(f"[{name}]: unknown section; {_suggest(name, _sections())}")
        if not isinstance(values, dict):
            raise ConfigError(f"{name} = {values!r}: must be a [{name}] table; fix the config file")
        sections[name] = _build_section(name, values, raws.get(name, {}))
    return Config(**sections)


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # numbers, and strings (JSON's escapes are TOML's)


def to_toml(config: Config) -> str:
    """The resolved config as TOML that load_config reads back unchanged."""
    lines = []
    for section, values in to_dict(config).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def write_resolved(config: Config, run_dir: Path) -> Path:
    path = Path(run_dir) / "config.toml"
    path.write_text(to_toml(config))
    return path
