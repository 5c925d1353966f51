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


def key(default, doc: str, *, choices: tuple = ()):
    """A config field with its meaning and, for a fixed set, its allowed values: the one source of docs/config.md,
    `distrib config` and `distrib config --toml` (distrib.config_reference). A dict default is copied per instance."""
    metadata = {"doc": doc, "choices": tuple(choices)}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def choices(section_type: type, name: str) -> tuple:
    """A field's allowed values, as its key() declares them (empty: any value of its type)."""
    return next(f.metadata["choices"] for f in dataclasses.fields(section_type) if f.name == name)


def _choice(section: str, obj, key: str) -> None:
    value, allowed = getattr(obj, key), choices(type(obj), key)
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


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def file_size(size: int | str) -> int:
    """Bytes of a size as save_pretrained's max_shard_size takes it: an int, or "5GB", "500MB", "2GiB"."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(size).lower())
    if isinstance(size, bool) or not found or found.group(2) not in _UNITS:
        raise ValueError("must be bytes, or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    nbytes = int(float(found.group(1)) * _UNITS[found.group(2)])
    if nbytes <= 0:
        raise ValueError("must be more than 0 bytes")
    return nbytes


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
    name: str = key("fashion-mnist",
        "`fashion-mnist`, `mnist`, `cifar10` (the python pickle batches in `data.root` or "
        "`data.root/cifar-10-batches-py`), `imagefolder` (`data.root/train/CLASS/*`, `data.root/test/CLASS/*`, any "
        "image PIL reads), `synthetic` (seeded, learnable, needs no files), `text` and `tokens` (language models: see "
        "docs/language-models.md)",
        choices=("fashion-mnist", "mnist", "cifar10", "imagefolder", "synthetic", "text", "tokens"))
    root: str = key("data",
        "your dataset folder, read only: unpacked or downloaded files go into torchvision's own subfolder "
        "(`FashionMNIST/raw`, ...) and the log says so; a folder that holds another dataset than `data.name` is "
        "refused")
    factory: str = key("",
        "`package.module:function` called with `data.kwargs`, returning `(train, test)`: map-style datasets of "
        "samples (see docs/data.md, Tasks), streams, or `(inputs, targets)` pairs of tensors or of dicts of tensors; "
        "wins over `data.name`")
    kwargs: dict = key({}, "keyword arguments of `data.factory`, e.g. `--set 'data.kwargs={size = 64}'`")
    loader: str = key("auto",
        "`device` (the whole set on the device, uint8 kept, batches sliced and normalised there), `dataloader`, or "
        "`auto`: device-resident for in-memory sets under half the free memory, DataLoader for file-backed sets",
        choices=("auto", "device", "dataloader"))
    num_workers: int = key(0,
        "DataLoader worker processes (DataLoader path only); its sampler yields this rank's slice of each global "
        "batch, in the same order as the device path")
    pin_memory: bool = key(True, "DataLoader path: page-locked host batches (accelerators only)")
    persistent_workers: bool = key(True,
        "DataLoader path: keep the worker processes between epochs (`data.num_workers` > 0)")
    prefetch_factor: int = key(2, "DataLoader path: batches each worker loads ahead (`data.num_workers` > 0)")
    image_size: int = key(0, "imagefolder: resize to N×N; 0 = as stored (another size is an error naming the file)")
    normalize: str | tuple[tuple[float, ...], ...] = key("auto",
        "`auto`: image-shaped inputs (`[C, H, W]`) with known statistics for named sets, otherwise computed once from "
        "up to 10,000 training samples and recorded; other inputs pass as given (the log says which). `none`, or "
        "`[[means], [stds]]` per channel in 0..1 units")
    augment: str = key("none",
        "`none`, `flip` or `crop_flip` (pad, random crop, horizontal flip): training only, batched on the device, "
        "keyed by (seed, epoch, sample index), so world-size invariant and exact on resume",
        choices=("none", "flip", "crop_flip"))
    crop_padding: int = key(4, "`crop_flip`: zero padding on each side before the random crop")
    num_classes: int = key(0,
        "synthetic: classes (0 = 10); other sets: 0 = from the data, or declared (labels checked against it)")
    synthetic_shape: tuple[int, ...] = key((1, 28, 28), "synthetic: (C, H, W) of one sample")
    eval_batch_size: int = key(1000,
        "samples per evaluation batch: the test set is cut into such batches and each rank takes a contiguous run of "
        "them, so every sample is counted once and its logits are the same at any world size")
    synthetic_train_size: int = key(8192, "synthetic: samples in the training set")
    synthetic_test_size: int = key(1000, "synthetic: samples in the test set")
    seq_len: int = key(256,
        "text, tokens: tokens per sample (the model's context); each sample is a window of `seq_len` inputs and the "
        "`seq_len` next tokens as targets")
    test_fraction: float = key(0.1,
        "text: the last share of the bytes (of the file, or of the folder's `.txt` files in sorted order), held out "
        "for evaluation")
    val_fraction: float = key(0.0,
        "the share of the training samples held out as a validation set (the same samples at every world size and "
        "seed), evaluated during training as `val_*`; the test set then only at the end (see "
        "docs/training-features.md); 0 = none")
    vocab_size: int = key(0,
        "tokens: the vocabulary size (required: every id in `train.bin`/`val.bin` must be below it; the GPT's "
        "embedding has this many rows); text is bytes, 256")
    collate: str = key("",
        "`package.module:function` of a list of samples returning a micro-batch (a dict of tensors, e.g. a Hugging "
        "Face data collator's, or an `(inputs, targets)` pair); `\"\"` = distrib stacks, right-padding dict samples "
        'of different lengths (see docs/data.md, Tasks)')
    pad_id: int = key(0, "the `input_ids` value of that padding (`attention_mask` 0, `labels` -100)")
    pad: str = key("auto",
        "`auto`: dict samples' 1-D ids are padded (and get an `attention_mask`) in every micro-batch when their "
        "lengths differ among the data's first samples (a stream's first 256, 256 spread over a dataset); `always`: "
        "padded even when those are all of one length", choices=("auto", "always"))
    train_files: str = key("",
        "tokens: a glob of training token shards, raw ids (`data.token_dtype`) or llm.c's (see "
        'docs/language-models.md), read as one stream; `""` = `data.root/train.bin`')
    test_files: str = key("",
        'tokens: a glob of held-out token shards, as `data.train_files`; `""` = `data.root/val.bin`')
    token_dtype: str = key("uint16",
        "tokens: the type of the ids in raw files (`train.bin`, `val.bin`, raw shards): `uint16` (nanoGPT's) or "
        "`uint32` (vocabularies over 65,536: Llama 3's 128,256, Qwen's 151,936); llm.c's shards say theirs in their "
        "header", choices=("uint16", "uint32"))
    document_mask: bool = key(False,
        "text, tokens: packed documents: each document of a window attends only to itself and its positions restart "
        "at its first token (after `data.eos_id`, and at each file's first token); see docs/language-models.md")
    eos_id: int = key(-1,
        "text, tokens with `data.document_mask`: the end-of-document token id (GPT-2's `<|endoftext|>` is 50256); "
        "-1 = none (the files are the documents)")

    def __post_init__(self):
        if self.factory:
            if not _FACTORY.match(self.factory):
                _fail("data", "factory", self.factory, "must look like package.module:function",
                      "e.g. --set data.factory=mypkg.data:build")
        else:
            _choice("data", self, "name")
        _choice("data", self, "loader")
        _choice("data", self, "augment")
        _choice("data", self, "pad")
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
        self._check_documents()

    def _check_tokens(self):
        _at_least("data", self, "seq_len", 1)
        if not (0.0 <= self.val_fraction < 1.0):
            _fail("data", "val_fraction", self.val_fraction, "must be in [0, 1)", "e.g. --set data.val_fraction=0.1")
        if not (0.0 < self.test_fraction < 1.0):
            _fail("data", "test_fraction", self.test_fraction, "must be in (0, 1)",
                  "e.g. --set data.test_fraction=0.1")
        if not (0 <= self.vocab_size <= 2**32):
            _fail("data", "vocab_size", self.vocab_size, "must be in [0, 4294967296] (token ids are at most uint32)",
                  "e.g. --set data.vocab_size=50304")
        _choice("data", self, "token_dtype")
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

    def _check_documents(self):
        if self.document_mask and (self.factory or self.name not in ("text", "tokens")):
            _fail("data", "document_mask", True, "packs the documents of text or tokens data only",
                  "--set data.name=tokens (or text), or --set data.document_mask=false")
        vocab = 256 if self.name == "text" else self.vocab_size
        if self.eos_id < -1 or (vocab and self.eos_id >= vocab):
            _fail("data", "eos_id", self.eos_id, f"must be a token id below the vocabulary ({vocab}), or -1 (none)",
                  "e.g. --set data.eos_id=50256 (GPT-2's <|endoftext|>)")
        if self.eos_id >= 0 and not self.document_mask:
            _fail("data", "eos_id", self.eos_id, "is read only by data.document_mask = true",
                  "--set data.document_mask=true, or leave data.eos_id at -1")
        if self.document_mask and self.eos_id < 0 and self.name == "tokens" and not self.train_files:
            _fail("data", "eos_id", self.eos_id, "data.document_mask needs the end-of-document id: one train.bin "
                  "is one file, so no document would start", "e.g. --set data.eos_id=50256 (GPT-2's <|endoftext|>)")

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
    name: str = key("network",
        "`gpt` (the built-in decoder-only transformer, `model.kwargs` as in docs/language-models.md), or the seed CNN "
        "(conv 1→6 5×5, conv 6→12 5×5, fc 192→120→60→classes), 1×28×28 inputs only: other shapes are one line naming "
        "the shape and `model.factory`", choices=("network", "gpt"))
    factory: str = key("",
        "`package.module:function` returning any `nn.Module`, called with `model.kwargs` (`--set 'model.kwargs={width "
        "= 64}'`) plus from the data what it declares by name (a `**kwargs` gets `model.kwargs` alone): `num_classes`; "
        "`in_channels`, `image_size` for images; `in_features` for float vectors; `seq_len` and `vocab_size` for "
        "integer sequences; wins over `model.name`")
    kwargs: dict = key({},
        "keyword arguments of `model.factory` or of the built-in model (`--set 'model.kwargs={width = 64}'`)")
    init_from: str = key("",
        "pretrained weights read into the built model before the first step (a resumed checkpoint wins): a Hugging "
        "Face folder or `.safetensors` file (one file, or several with `model.safetensors.index.json`), a distrib run "
        "directory (its `weights/`, else `model.pt`), or a checkpoint (`step_N.pt`, or a sharded `step_N/`); names "
        'and shapes must match (see docs/checkpoints.md, Pretrained weights in); `fit(..., init_from=PATH)` too')
    merged_weights: bool = key(True,
        "a peft (LoRA) model: besides the adapter in `weights/`, the merged model (each LoRA delta added to its base "
        "weight, under the base model's names) in `weights/merged/`, which `from_pretrained` loads alone; `false` "
        "skips it (it is as large as the base model)")
    max_shard_size: int | str = key("5GiB",
        "the largest safetensors file of `weights/` (and `weights_ema/`, `weights/merged/`), as `save_pretrained`'s "
        "`max_shard_size`: `\"500MB\"`, `\"2GiB\"` or bytes; a larger model's files come with "
        "`model.safetensors.index.json`. Under a sharded strategy (fsdp, hsdp, tensor or pipeline parallel) "
        "`model.pt` is gathered whole on rank 0, so it is written only for a model of at most this size and 256 MiB: "
        "rank 0's end-of-run save holds at most one such file more than the other ranks")

    @property
    def max_shard_bytes(self) -> int:
        return file_size(self.max_shard_size)

    def __post_init__(self):
        try:
            file_size(self.max_shard_size)
        except ValueError as e:
            _fail("model", "max_shard_size", self.max_shard_size, str(e), "e.g. --set model.max_shard_size=2GB")
        if self.factory:
            if not _FACTORY.match(self.factory):
                _fail("model", "factory", self.factory, "must look like package.module:function",
                      "e.g. --set model.factory=mypkg.models:build")
        else:
            _choice("model", self, "name")


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainConfig:
    epochs: int = key(12,
        "passes over the training data; the run stops at `train.epochs` or `train.max_steps`, whichever comes first; "
        "0 = bounded by `train.max_steps` only")
    max_steps: int = key(0,
        "optimizer steps; the run stops at whichever of `train.epochs` and `train.max_steps` comes first; 0 = no limit")
    global_batch_size: int = key(128,
        "samples per optimizer step over all workers; must divide by workers × `grad_accum_steps`")
    grad_accum_steps: int = key(1, "micro-steps per optimizer step; DDP syncs only in the last")
    lr: float = key(0.05, "the peak learning rate (after warm-up)")
    optimizer: str = key("sgd",
        "`sgd` (with `train.momentum`), `adam`, `adamw`, or `package.module:function`, `(parameters or groups, train "
        "config) -> Optimizer`")
    momentum: float = key(0.9, "`sgd` only: its momentum")
    betas: tuple[float, ...] = key((0.9, 0.999),
        "adam, adamw: the coefficients of the moving averages (transformers often use `[0.9, 0.95]`)")
    weight_decay: float = key(0.0, "weight decay (every optimizer; see `train.decay`)")
    decay: str = key("weights",
        "adam, adamw with weight decay: `weights` decays the weight matrices only, not biases, norms or embeddings "
        "(two parameter groups, named in one log line); `all` decays every parameter", choices=("weights", "all"))
    schedule: str = key("cosine",
        "`constant` or `cosine` (to zero), each after a linear warm-up of `train.warmup_steps`",
        choices=("constant", "cosine"))
    schedule_steps: int = key(0,
        "the cosine's length in steps; 0 = this run's total steps. Set it when a run may be extended "
        "(docs/checkpoints.md, Extending a finished run)")
    warmup_steps: int = key(100, "steps of linear warm-up from 0 to `train.lr`")
    grad_clip: float = key(0.0, "max global gradient norm; 0 = off")
    seed: int = key(0, "initial weights and the data order")
    precision: str = key("fp32", "`bf16` autocast, or `fp16` with a GradScaler", choices=("fp32", "bf16", "fp16"))
    log_every: int = key(50,
        "optimizer steps between log lines (each one reads the loss on the host: a sync); the last step is always "
        "logged")
    eval_every_epochs: int = key(1,
        "evaluate on the test set after every N epochs; 0 = only at the end (the end always evaluates)")
    finite_check_every: int = key(1,
        "steps between checks that the all-reduced gradients are finite (0 = never); a flag kept on the device, read "
        "at the next sync step (no host read of its own)")
    sync_every: int = key(10,
        "steps between the ranks' small all-reduce of (loss, stop votes, finite flag); log and checkpoint steps "
        "always sync")
    early_stop_metric: str = key("",
        "`test_loss`, `test_accuracy` (or `test_loss_ema`, `test_accuracy_ema` with EMA on), or with a validation set "
        "`val_loss`, `val_accuracy` (and their `_ema` forms): stop when it stops improving; `""` = off",
        choices=EVAL_METRICS + ("",))
    early_stop_patience: int = key(3, "evaluations in a row without an improvement before every rank stops")
    early_stop_min_delta: float = key(0.0, "an improvement must exceed this to count")
    ema_decay: float = key(0.0,
        "keep an exponential moving average of the weights (e.g. 0.999), updated after every optimizer step; 0 = off")
    loss: str = key("cross_entropy",
        "`cross_entropy` (classes per sample or per position, -100 not counted), `mse`, `l1`, `bce_with_logits` "
        "(multi-label), or `package.module:function`, `(outputs, targets) -> scalar mean`, which receives the model's "
        "outputs whole; a model whose output has a `loss` trains on that in place of a built-in loss; the output's "
        "other `*loss` keys (`aux_loss`) are logged, and added to a built-in loss; evaluation reports the test loss of "
        "the same loss")
    label_smoothing: float = key(0.0, "`cross_entropy` only: label smoothing in [0, 1)")
    callbacks: tuple[str, ...] = key((),
        "`package.module:Class` each, called with no arguments: objects with any of the hooks "
        "`on_train_start(model)`, `on_step_end(step, loss)`, `on_evaluate(step, metrics)`, `on_train_end(summary)`, "
        "called on every rank in this order (then `fit(callbacks=...)`'s); see docs/training-features.md")

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
        _choice("train", self, "decay")
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
        _choice("train", self, "schedule")
        _choice("train", self, "precision")
        _at_least("train", self, "weight_decay", 0.0)
        _at_least("train", self, "grad_clip", 0.0)
        if not (0.0 <= self.momentum < 1.0):
            _fail("train", "momentum", self.momentum, "must be in [0, 1)", "e.g. --set train.momentum=0.9")
        if not (0.0 <= self.ema_decay < 1.0):
            _fail("train", "ema_decay", self.ema_decay, "must be in [0, 1)", "e.g. --set train.ema_decay=0.999")
        _choice("train", self, "early_stop_metric")
        _at_least("train", self, "early_stop_patience", 1)
        _at_least("train", self, "early_stop_min_delta", 0.0)
        _needs_ema("train", "early_stop_metric", self.early_stop_metric, self.ema_decay)
        if self.early_stop_metric and not self.eval_every_epochs:
            _fail("train", "early_stop_metric", self.early_stop_metric, "needs evaluations during training, and "
                  "train.eval_every_epochs = 0", "--set train.eval_every_epochs=1")


@dataclass(kw_only=True, frozen=True, slots=True)
class RunConfig:
    dir: str = key("runs/default",
        "outputs; under fsdp, hsdp and tensor parallel one folder shared by every node (every rank writes its part of "
        "`weights/`; checked at start)")
    progress: bool | str = key("auto",
        "tqdm bar on rank 0: `auto` (only when stderr is a terminal; a log file gets plain lines, no carriage "
        "returns), `true`, `false`")

    def __post_init__(self):
        if not self.dir:
            _fail("run", "dir", self.dir, "must not be empty", "e.g. --set run.dir=runs/exp1")
        if isinstance(self.progress, str) and self.progress != "auto":
            _fail("run", "progress", self.progress, "must be auto, true or false", "e.g. --set run.progress=auto")


@dataclass(kw_only=True, frozen=True, slots=True)
class DistConfig:
    device: str = key("auto",
        "`auto` (CUDA when present), `cpu`, or `cuda` (an error when CUDA is missing)", choices=("auto", "cpu", "cuda"))
    timeout_s: float = key(60.0,
        "a collective that waits longer fails (exit 69), naming the ranks it waited for; raise it if one rank may "
        "work alone longer (a large checkpoint to a slow disk)")
    strategy: str = key("ddp",
        "`ddp`: a whole replica per rank; `fsdp`: FSDP2 (`fully_shard`) shards parameters, gradients and optimizer "
        "state over all ranks; `hsdp`: FSDP2 on a 2-D mesh (`replicate` × `shard`): sharded within groups of "
        "`dist.shard_size` ranks, replicated across the groups (see docs/parallelism.md)",
        choices=("ddp", "fsdp", "hsdp"))
    shard_size: int = key(0,
        "hsdp: ranks per shard group; 0 = one node's (`LOCAL_WORLD_SIZE` / `dist.tensor_parallel` / "
        "`dist.context_parallel`). Must divide the data-parallel ranks; set under another strategy, refused")
    tensor_parallel: int = key(1,
        "ranks that split each layer of a model that declares a plan (the built-in GPT), on the innermost mesh "
        "dimension, composed with fsdp or hsdp on the others; the ranks of one group read the same micro-batches. "
        'Must divide the world and the heads; refused under ddp, and for a model without `_tp_plan` (see '
        'docs/parallelism.md)')
    pipeline_parallel: int = key(1,
        "pipeline stages by depth (the outermost mesh dimension): each rank holds only its stages' layers, built on "
        "meta; composes with ddp, fsdp or hsdp on the data-parallel ranks and with `dist.tensor_parallel` inside a "
        "stage. Must divide the world (see docs/parallelism.md, Pipeline parallelism)")
    expert_parallel: int = key(1,
        "ranks of a shard group that split each MoE layer's experts among them (the `ep` dimension, taken from the "
        "fsdp or hsdp ranks: they read different batches), tokens sent to their expert's rank and back by all-to-all; "
        "the rest of the shard group shards each rank's experts. Must divide the shard group (hsdp: "
        "`dist.shard_size`) and every MoE layer's experts; refused under ddp and for a model without experts (see "
        "docs/parallelism.md, Expert parallelism)")
    context_parallel: int = key(1,
        "ranks that each hold a 1/C cut of every sequence (the `cp` mesh dimension, between the shard and tensor "
        "ranks; they read the same micro-batches): two chunks of 2C, one from the head and its mirror from the tail "
        "(balanced for causal attention), rotary positions the tokens' global ones, keys and values all-gathered "
        "across the C ranks in each attention; fsdp shards over the shard and cp ranks together. Must divide the "
        "world, and 2C must divide `data.seq_len`; the built-in GPT and transformers decoders (through their "
        "attention interface), packed documents masked by their documents in the whole window; beside "
        "`dist.pipeline_parallel` the built-in GPT only, unpacked; refused under ddp and expert parallel (see "
        "docs/layouts.md)")
    pipeline_schedule: str = key("1f1b",
        "`gpipe` (every forward, then every backward), `1f1b` (one forward, one backward: fewer activations in "
        "flight), `interleaved_1f1b` (`dist.pipeline_stages_per_rank` stages per rank: a smaller bubble), `zbv` or "
        "`dualpipev` (two stages per rank in a V, backward split into input and weight gradients)",
        choices=("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"))
    pipeline_microbatches: int = key(0,
        "pieces each data-parallel rank's micro-batch is cut into for the pipeline (more: a smaller bubble, smaller "
        "matrix products); must divide the micro-batch; 0 = the number of stages")
    pipeline_stages_per_rank: int = key(0,
        "stages each pipeline rank holds: 1 for `gpipe` and `1f1b`, 2 or more for `interleaved_1f1b`, 2 for `zbv` "
        "and `dualpipev`; 0 = the schedule's default (2 for the multi-stage schedules)")
    pipeline_split: tuple[str, ...] = key((),
        'the modules that start a new stage, as torchtitan\'s split points (`["layers.4", "layers.8"]`: one fewer '
        "than the stages); empty = the model's own balanced split (the built-in GPT splits by blocks: embeddings "
        "with the first stage, the final norm and output with the last); an `nn.Sequential` of the user's needs it")
    shard_modules: str | tuple[str, ...] = key("auto",
        'the blocks: module class names (`["TransformerBlock"]`), or `auto`: the classes the model lists in '
        "`_no_split_modules` (the Hugging Face convention; the built-in GPT's `Block`), else children, looking inside "
        "`ModuleList`/`Sequential`, with at least 1/64 of the parameters; each gets `fully_shard`, then the root")
    reshard_after_forward: bool = key(True,
        "fsdp, hsdp: free gathered parameters after forward (less memory, one more all-gather in backward)")
    cpu_offload: bool = key(False,
        "fsdp, hsdp: parameter, gradient and optimizer shards live in host memory (`CPUOffloadPolicy`)")
    sync_batchnorm: bool = key(False,
        "BatchNorm statistics over each micro-step's global batch (SyncBatchNorm; GPUs only). Without it a BatchNorm "
        "model's statistics are per micro-batch, and the log says that world sizes then no longer agree exactly")
    find_unused_parameters: bool | str = key("auto",
        "ddp: DDP's `find_unused_parameters`, for a model whose parameters get no gradient in some steps (experts, "
        "conditional branches): `auto` turns it on when the model has experts lists (a `ModuleList` named `*experts`) "
        "or the first batch leaves a trainable parameter without a gradient, and the log says so; `true`, `false`. "
        "fsdp and hsdp need no key: FSDP2 reduces zeros for such parameters")
    fault_tolerant_groups: int = key(1,
        "replica groups of the data-parallel replicate degree run under torchft (`pip install distrib[ft]`): each "
        "group is its own world of world size / G ranks (ddp or fsdp inside), the groups all-reduce their gradients "
        "through torchft, and a failed group is restarted alone and heals from a live one while the others train on; "
        "1 = off (see docs/fault_tolerance.md)")
    min_replicas: int = key(1,
        "fault-tolerant groups: the fewest groups a step may commit with (the first step waits for all of them)")
    fault_tolerant_timeout_s: float = key(10.0,
        "fault-tolerant groups: how long the all-reduce across the groups waits for a group that hangs before the "
        "step is taken again without it (a group that dies stalls the others about 5 s, the Lighthouse's heartbeat "
        "timeout); quorums, heals and the rest wait `dist.timeout_s`")

    def __post_init__(self):
        """The keys' own ranges and choices. The rules of a strategy (which keys it takes, which precision and
        checkpoints its state allows) are its class's: distrib.distributed.strategies.check_config, run before any
        worker starts by distrib train, distrib plan, distrib.fit and the worker itself."""
        _choice("dist", self, "device")
        _positive("dist", self, "timeout_s", 60)
        _choice("dist", self, "strategy")  # the names the strategy classes register (kept equal by a unit test)
        names = (self.shard_modules,) if isinstance(self.shard_modules, str) else self.shard_modules
        if not names or not all(isinstance(n, str) and n.isidentifier() for n in names):
            _fail("dist", "shard_modules", self.shard_modules, "must be auto or a list of module class names",
                  "e.g. --set 'dist.shard_modules=[\"TransformerBlock\"]'")
        _at_least("dist", self, "shard_size", 0)
        _at_least("dist", self, "tensor_parallel", 1)
        _at_least("dist", self, "expert_parallel", 1)
        _at_least("dist", self, "context_parallel", 1)
        if isinstance(self.find_unused_parameters, str) and self.find_unused_parameters != "auto":
            _fail("dist", "find_unused_parameters", self.find_unused_parameters, "must be auto, true or false",
                  "e.g. --set dist.find_unused_parameters=true")
        self._check_pipeline()
        _at_least("dist", self, "fault_tolerant_groups", 1)
        _at_least("dist", self, "min_replicas", 1)
        _positive("dist", self, "fault_tolerant_timeout_s", 10)  # against the groups: dimensions.replica_groups

    MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv", "dualpipev")

    @property
    def stages_per_rank(self) -> int:
        """dist.pipeline_stages_per_rank, its default resolved: 2 for the schedules of several stages per rank."""
        if self.pipeline_stages_per_rank:
            return self.pipeline_stages_per_rank
        return 2 if self.pipeline_schedule in self.MULTI_STAGE_SCHEDULES else 1

    def _check_pipeline(self) -> None:
        _at_least("dist", self, "pipeline_parallel", 1)
        _choice("dist", self, "pipeline_schedule")
        _at_least("dist", self, "pipeline_microbatches", 0)
        _at_least("dist", self, "pipeline_stages_per_rank", 0)
        if not all(isinstance(name, str) and name for name in self.pipeline_split):
            _fail("dist", "pipeline_split", self.pipeline_split, "must be a list of module names",
                  "e.g. --set 'dist.pipeline_split=[\"layers.2\"]'")
        if self.pipeline_parallel == 1 and self.pipeline_split:
            _fail("dist", "pipeline_split", self.pipeline_split, "splits the model into pipeline stages, and "
                  "dist.pipeline_parallel is 1", "set --set dist.pipeline_parallel=2 (or more), or drop it")
        # The schedule's own rules, and what a pipeline cannot compose with: distrib.distributed.dimensions.pipeline.


@dataclass(kw_only=True, frozen=True, slots=True)
class CheckpointConfig:
    dir: str = key("", "one directory shared by every node; `\"\"` = `run.dir/checkpoints`")
    every_steps: int = key(500, "optimizer steps between checkpoints; 0 = only at the end and on preemption")
    resume: str = key("auto", "`auto`: the newest good checkpoint in `dir`, if any; `never`; or a path")
    keep_last: int = key(2,
        "this run's older ones are deleted only after the new one is safely in place, so 1 is safe; never another "
        "run's")
    signals: str = key("SIGTERM,SIGUSR1", "checkpoint at the next step boundary and exit 75")
    allow_config_change: bool = key(False,
        "resume although model, data (its files or objects: docs/checkpoints.md, The data a resume reads), seed, "
        "optimizer or global batch changed; the log says what changed")
    async_save: bool | str = key("off",
        "sharded checkpoints (fsdp, hsdp) written in the background: `process` (a checkpoint process of each rank "
        "writes what the step copied to shared memory: the step waits only for that copy), `thread` (a thread of "
        "the worker writes: the copy, and the write's share of the interpreter), `off`; `true` means `process`. "
        "One write at a time; a checkpoint counts once its folder is renamed into place (docs/checkpoints.md)",
        choices=("off", "thread", "process"))
    keep_best: int = key(0,
        "also keep the checkpoints of the k best evaluations as `best_STEP.pt` (ddp) or `best_STEP/` (fsdp), "
        "`best_STEP-RUNID` beside another run's; `keep_last` never prunes them; 0 = off")
    best_metric: str = key("test_loss",
        "what `keep_best` ranks by: `test_loss`, `test_accuracy` (or their `_ema` forms), or with a validation set "
        "`val_loss`, `val_accuracy` (and `_ema`)", choices=EVAL_METRICS)
    foreign: str = key("refuse",
        "a new run in a `dir` holding another run's checkpoints: `refuse` (one line naming the choices), or `keep` "
        "(train beside them for good: its own are named `step_N-RUNID`, theirs are never touched, and `resume=auto` "
        "continues the run that saved last)", choices=("refuse", "keep"))

    def __post_init__(self):
        if isinstance(self.async_save, bool):  # the key's older form: true was the background write, now a process
            object.__setattr__(self, "async_save", "process" if self.async_save else "off")
        _choice("checkpoint", self, "async_save")
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
        _choice("checkpoint", self, "foreign")
        if not self.resume:
            _fail("checkpoint", "resume", self.resume, "must be auto, never or a path",
                  "e.g. --set checkpoint.resume=auto")
        _at_least("checkpoint", self, "keep_best", 0)
        _choice("checkpoint", self, "best_metric")


@dataclass(kw_only=True, frozen=True, slots=True)
class SpeedConfig:
    compile: bool = key(False,
        "`torch.compile` the model, under every strategy: ddp compiles the whole model over DDP; fsdp, hsdp, tensor "
        "and pipeline parallel compile each block (`dist.shard_modules`; under pipeline parallel each rank its own "
        "stages') in place, after tensor parallel and before sharding; its "
        "warm-up steps stay out of the throughput figures")
    compile_mode: str = key("default",
        "`torch.compile`'s mode: `default`, `reduce-overhead` (CUDA graphs, on CUDA devices only: elsewhere the same "
        "as `default`), `max-autotune` or `max-autotune-no-cudagraphs`",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    channels_last: bool = key(False, "NHWC weights and 4-D inputs (tensor-core convolutions)")
    gradient_as_bucket_view: bool = key(False,
        "DDP: gradients are views into the all-reduce buckets (one copy and its memory less)")
    static_graph: bool = key(False,
        "DDP: the same parameters get gradients every step; not with `train.grad_accum_steps` > 1")
    bucket_cap_mb: float = key(0.0, "DDP gradient bucket size in MB; 0 = DDP's default (25, with a 1 MB first bucket)")
    activation_checkpointing: str = key("none",
        "`blocks`: each block keeps only its inputs and recomputes in backward (either strategy; same weights)",
        choices=("none", "blocks"))

    def __post_init__(self):
        _choice("speed", self, "compile_mode")
        _choice("speed", self, "activation_checkpointing")
        _at_least("speed", self, "bucket_cap_mb", 0.0)


LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(kw_only=True, frozen=True, slots=True)
class MetricsConfig:
    loggers: tuple[str, ...] = key(("jsonl",),
        "any of `jsonl` (always on), `tensorboard`, `wandb`, `mlflow`; rank 0 only", choices=LOGGERS)
    tensorboard: bool = key(False, "the same as naming `tensorboard` in `metrics.loggers` (kept for existing configs)")
    project: str = key("distrib", "the W&B project / MLflow experiment")
    run_name: str = key("", "the tracker run's name; `\"\"` = the name of `run.dir`")
    tags: tuple[str, ...] = key((), "W&B tags / MLflow run tags")
    mlflow_uri: str = key("",
        'MLflow tracking URI (`http://host:5000`, `file:/path/mlruns`); `""` = `MLFLOW_TRACKING_URI` if set, else '
        "`file:RUN_DIR/mlruns`")
    logger_errors: str = key("fail",
        "a tracker that cannot start (no login, server down): `fail` = one line, exit 2 before training; `warn` = a "
        "warning, and the run goes on with the other loggers", choices=("fail", "warn"))
    peak_flops: float = key(0.0,
        "peak FLOP/s of one device for MFU; 0 = `distrib.training.throughput`'s table (H100/H200/A100/...; CPU: 1e11 "
        "per thread)")
    timing_skip_steps: int = key(5, "first steps left out of samples/s and step times (compile, warm-up)")
    eval: tuple[str, ...] = key((),
        "the user's metrics, `package.module:function` each, `(outputs, targets) -> {name: (sum, count)}`, reported "
        "as `test_<name>`, summed exactly over the test set")

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
        _choice("metrics", self, "logger_errors")
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
