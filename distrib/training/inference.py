"""Using a trained model (loaded by distrib.training.trained): model.json beside model.pt, and the exact test metrics
(`distrib eval`) and per-sample predictions (`distrib predict`) at any world size."""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.config import Config
from distrib.data import DataInfo, eval_batches, load_data, load_inputs
from distrib.distributed.parallel import unwrap
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import for_trained
from distrib.errors import UserError
from distrib.metrics import write_json_atomic
from distrib.models.build import factory_call
from distrib.training.evaluation import autocast, evaluate
from distrib.training.losses import build_loss
from distrib.training.preflight import dry_batch, task_for
from distrib.training.trained import Trained, rebuilt_model

CARD_FORMAT, CARD_VERSION = "distrib.model", 1
SPLITS = ("test", "train")  # `--input test`: a split of the run's own data; a folder of that name is ./test
MAX_TOP_K = 5


# ---------------------------------------------------------------- model.json


def model_card(config: Config, info: DataInfo, weights: str = "model.pt") -> dict:
    """What inference needs beside model.pt: how to build the model, what goes in, what comes out."""
    factory, kwargs = factory_call(config.model, info)
    model = {"factory": factory, "kwargs": json.loads(json.dumps(kwargs, default=str))}  # a TOML date as text
    if not config.model.factory:
        model["name"] = config.model.name
    return {"format": CARD_FORMAT, "version": CARD_VERSION, "distrib_version": _distrib_version(),
            "weights": weights, "model": model,
            "data": info.to_dict(),
            "inputs": _card_inputs(info),
            "precision": config.train.precision}


def _card_inputs(info: DataInfo) -> str:
    if not info.mean:  # not images: the model took the data's inputs as they were
        return f"per sample {info.inputs}, as the data gave them; targets per sample {info.targets}"
    return ("float32 (N, C, H, W) shaped like data.input_shape: images as pixels / 255 (float data as it is), then "
            "(x - mean) / std per channel; outputs: logits (N, num_classes), in class_names' order")


def write_model_card(path: Path, config: Config, info: DataInfo, weights: str = "model.pt") -> Path:
    """Writes model.json atomically (temp file, then rename); rank 0 only, like model.pt."""
    write_json_atomic(Path(path), model_card(config, info, weights))
    return Path(path)


def _distrib_version() -> str:
    try:
        return metadata.version("distrib")
    except metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------- a trained model, placed


def placed_model(trained: Trained, info: DataInfo, runtime: Runtime) -> nn.Module:
    """The trained model placed and wrapped exactly as training did (channels_last and all), so that its logits,
    and the metrics computed from them, are the same bits as at the end of training."""
    strategy = for_trained(trained.config.dist, runtime)
    return strategy.setup_trained(rebuilt_model(trained, info), runtime, trained.config.speed)


def check_rebuildable(trained: Trained, input_arg: str | None = None) -> None:
    """Refuses, before any data is read, a run whose data its config cannot load: one trained through distrib.fit()
    on datasets given in Python. input_arg: distrib predict's --input (a folder needs no training data)."""
    if input_arg is not None and input_arg not in SPLITS:
        return
    if trained.data is not None and trained.data.get("name") == "custom":
        raise UserError(f"{trained.source}: trained through distrib.fit() on datasets given in Python, which "
                        "distrib eval and predict cannot load; use distrib.training.evaluation.evaluate in Python, "
                        "or distrib predict --input a folder of images")


def _load_data(trained: Trained, runtime: Runtime):
    """The run's data, as its config loads it, refused when it is not the data the model was trained on."""
    check_rebuildable(trained)  # distrib eval and predict check it before any worker; a caller in Python may not
    data = load_data(trained.config.data, runtime, trained.config.train.seed)
    if trained.data is not None and trained.data != data.info.to_dict():
        changed = [f"{key} {trained.data.get(key)!r} -> {value!r}" for key, value in data.info.to_dict().items()
                   if trained.data.get(key) != value]
        raise UserError(f"{trained.source}: the config loads other data than the model was trained on "
                        f"({'; '.join(changed)[:300]}); give the run's data with --set data.name=..., data.root=...")
    return data


# ---------------------------------------------------------------- distrib eval


def evaluate_trained(trained: Trained, runtime: Runtime, out: Path) -> dict:
    """The trainer's own final evaluation (same function, loss, batches) on the trained weights; rank 0 writes `out`
    (eval.json)."""
    config = trained.config
    data = _load_data(trained, runtime)
    model = placed_model(trained, data.info, runtime)
    dry = dry_batch(model, data.test, data.info, runtime.device, build_loss(config.train))  # the task, as trained
    metrics = evaluate(model, data.test, data.info.num_classes, config.data.eval_batch_size, runtime, dry.loss,
                       config.train.precision, data.info.class_names, task_for(dry, config.metrics.eval))
    result = {"source": str(trained.source), "step": trained.step, "world_size": runtime.world_size,
              "device": str(runtime.device), **metrics}
    if runtime.is_main:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, result)
    return result


# ---------------------------------------------------------------- distrib predict


def check_input(input_arg: str) -> None:
    """A split name, or a folder that exists; its images are checked when they are read."""
    if input_arg not in SPLITS and not Path(input_arg).is_dir():
        raise UserError(f"--input {input_arg!r}: no such folder; give a folder of images, or a split: "
                        f"{' or '.join(SPLITS)}")


def _recorded_info(trained: Trained) -> DataInfo | None:
    """The DataInfo the run recorded, so a folder can be predicted without loading the training data."""
    names = {f.name for f in dataclasses.fields(DataInfo)}
    if not trained.data or not names <= trained.data.keys():
        return None
    return DataInfo(**{k: tuple(v) if isinstance(v, list) else v for k, v in trained.data.items() if k in names})


def _inputs(trained: Trained, input_arg: str, runtime: Runtime):
    """(info, sources, batch source): `split:index` for a split, image paths (sorted) for a folder."""
    if input_arg in SPLITS:
        data = _load_data(trained, runtime)
        source = data.test if input_arg == "test" else data.train
        return data.info, [f"{input_arg}:{i}" for i in range(source.num_samples)], source
    info = _recorded_info(trained) or _load_data(trained, runtime).info
    config = trained.config.data
    paths, source = load_inputs(Path(input_arg), info, config.image_size or None, runtime, config.num_workers)
    return info, paths, source


def predict_trained(trained: Trained, runtime: Runtime, input_arg: str, out: Path) -> int:
    """Writes one JSON line per input to `out`, in input order at any world size; returns the number of lines."""
    config = trained.config
    info, sources, source = _inputs(trained, input_arg, runtime)
    if not (info.num_classes and info.targets.endswith(" []")) and info.targets:
        raise UserError(f"{trained.source}: distrib predict writes one class per sample, and this model was trained "
                        f"on targets {info.targets}; use distrib eval for its test metrics")
    # The plain module, as evaluation runs it: DDP's forward would sync buffers, and ranks may differ in batches.
    model = unwrap(placed_model(trained, info, runtime)).eval()
    top_k = min(MAX_TOP_K, info.num_classes)
    # Each rank takes a contiguous run of the fixed batches (as in evaluation), so rank order is input order.
    local = []
    with torch.no_grad(), autocast(config.train.precision, runtime.device):
        for inputs, targets in source.batches(eval_batches(len(sources), config.data.eval_batch_size,
                                                           runtime.rank, runtime.world_size)):
            probs, labels = model(inputs).float().softmax(dim=1).topk(top_k, dim=1)
            local.append((probs.cpu(), labels.cpu(), targets.cpu()))
    gathered = [None] * runtime.world_size if runtime.is_main else None
    dist.gather_object(local, gathered, dst=0)  # every rank takes part; rank 0 alone writes
    if runtime.is_main:
        _write_lines(out, sources, [part for parts in gathered for part in parts], info.class_names)
    return len(sources)


def _write_lines(out: Path, sources: list[str], parts: list, class_names) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    rows = iter(sources)
    with open(tmp, "w") as f:
        for probs, labels, targets in parts:
            for row_probs, row_labels, target in zip(probs.tolist(), labels.tolist(), targets.tolist()):
                line = {"source": next(rows), "label": row_labels[0], "class_name": class_names[row_labels[0]],
                        "top_k": [{"label": label, "class_name": class_names[label], "probability": prob}
                                  for label, prob in zip(row_labels, row_probs)]}
                if target >= 0:  # a split's true label; folder inputs have none (-1)
                    line["target"] = target
                f.write(json.dumps(line) + "\n")
    assert next(rows, None) is None, "every input got exactly one line"
    os.replace(tmp, out)
