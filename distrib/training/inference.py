"""Using a trained model: model.json beside model.pt, loading a model from a run directory or a checkpoint, and the
exact test metrics (`distrib eval`) and per-sample predictions (`distrib predict`) at any world size."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.checkpoint.format import list_checkpoints, load_failure, read_checkpoint
from distrib.checkpoint.weights import INDEX, SINGLE, WEIGHTS_DIR, aliases_of, read_weights
from distrib.config import Config, load_config
from distrib.data import DataInfo, eval_batches, load_data, load_inputs
from distrib.distributed.parallel import unwrap
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import for_trained
from distrib.errors import UserError
from distrib.metrics import write_json_atomic
from distrib.models import adapters
from distrib.models.build import build_model, factory_call
from distrib.training.evaluation import autocast, evaluate
from distrib.training.losses import build_loss
from distrib.training.preflight import dry_batch, task_for

CARD_FORMAT, CARD_VERSION = "distrib.model", 1
ADAPTER_CONFIG = "adapter_config.json"  # peft's: a folder of an adapter alone
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


# ---------------------------------------------------------------- a trained model, from a run dir or a checkpoint


@dataclass(frozen=True)
class Trained:
    """A trained model's weights (the unwrapped state_dict, on the CPU) and the config it was trained with."""

    source: Path  # the run directory, weights folder or checkpoint file the user gave
    config: Config
    weights: dict
    step: int | None  # the checkpoint's step, or the run's last (summary.json's steps)
    data: dict | None  # the DataInfo it was trained on, as recorded (summary.json, model.json, a checkpoint)

    @property
    def out_dir(self) -> Path:
        """Where eval.json goes: in the run directory, beside the checkpoint file, or beside the weights folder
        (weights/merged/: beside weights/), so that an export stays as it was written."""
        folder = self.source if self.source.is_dir() else self.source.parent
        while _is_weights_folder(folder):
            folder = folder.parent
        return folder


def load_trained(source: str, config_path: str | None = None, overrides=()) -> Trained:
    """RUN_DIR (its model.pt, else its weights/, and config.toml), RUN_DIR/model.pt, a folder of safetensors (a
    run's weights/ or weights_ema/, a Hugging Face folder: its own weights, built by the config of the run that holds
    it), or a checkpoint file (its stored config); --config replaces the config and --set overrides it. Reads on the
    CPU, before any process group."""
    path = Path(source)
    if path.is_file() and path.name == "model.pt":
        path = path.parent
    if path.is_dir() and _is_weights_folder(path):
        return _from_weights_folder(path, config_path, overrides)
    if path.is_dir():
        return _from_run_dir(path, config_path, overrides)
    if path.is_file():
        state = read_checkpoint(path, torch.device("cpu"))  # a CheckpointError names the file and the reason
        config = load_config(config_path, overrides, base=None if config_path else state["config"])
        return Trained(path, config, state["model"], state["progress"]["step"], state.get("data"))
    raise UserError(f"{source!r}: no such run directory or checkpoint file; give a run.dir that holds model.pt, "
                    "or a checkpoint such as RUN_DIR/checkpoints/step_00000500.pt")


def _from_run_dir(run_dir: Path, config_path: str | None, overrides) -> Trained:
    weights_path = run_dir / "model.pt"
    if not weights_path.is_file() and not (run_dir / WEIGHTS_DIR).is_dir():
        found = list_checkpoints(run_dir / "checkpoints")
        fix = (f"give one of its checkpoints instead, e.g. {found[0]}" if found else
               "they are written when training ends: finish the run, or give a checkpoint file")
        raise UserError(f"run directory {run_dir}: no model.pt or {WEIGHTS_DIR}/; {fix}")
    config_file = Path(config_path) if config_path else run_dir / "config.toml"
    if not config_path and not config_file.is_file():
        raise UserError(f"run directory {run_dir}: no config.toml; give the config it was trained with: --config FILE")
    config = load_config(str(config_file), overrides)
    weights = _read_weights(weights_path) if weights_path.is_file() else _read_safetensors(run_dir / WEIGHTS_DIR)
    return Trained(run_dir, config, weights, *_run_records(run_dir))


def _run_records(run_dir: Path | None) -> tuple[int | None, dict | None]:
    """(its last step, the data it was trained on) as a run directory's summary.json and model.json record them."""
    card, summary = (_read_json(run_dir / name) if run_dir else None for name in ("model.json", "summary.json"))
    return (summary or {}).get("steps"), (summary or {}).get("data") or (card or {}).get("data")


def _is_weights_folder(path: Path) -> bool:
    """A folder of safetensors weights (save_pretrained's files, a peft adapter's) rather than a run directory."""
    return any((path / name).is_file() for name in (SINGLE, INDEX, ADAPTER_CONFIG))


def _from_weights_folder(folder: Path, config_path: str | None, overrides) -> Trained:
    """The folder's own weights (a run's weights/ or weights_ema/, any Hugging Face folder), built by --config or by
    the config.toml of the run that holds it: its parent, or above (weights/merged/)."""
    run_dir = next((p for p in (folder.parent, folder.parent.parent) if (p / "config.toml").is_file()), None)
    if (folder / ADAPTER_CONFIG).is_file():
        whole = f"{run_dir} (its model.pt) or " if run_dir and (run_dir / "model.pt").is_file() else ""
        merged = f"{folder / 'merged'}" if (folder / "merged").is_dir() else "a merged folder (model.merged_weights)"
        raise UserError(f"{folder}: a peft adapter alone, not a whole model, so distrib eval cannot evaluate it; give "
                        f"{whole}{merged}")
    if not config_path and run_dir is None:
        raise UserError(f"{folder}: a folder of weights outside a distrib run (no config.toml beside it or above it); "
                        "give the config that builds its model and loads its data: --config FILE")
    config = load_config(config_path or str(run_dir / "config.toml"), overrides)
    return Trained(folder, config, _read_safetensors(folder), *_run_records(run_dir))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({type(e).__name__}: {e}); restore it or delete it") from None


def _read_weights(path: Path) -> dict:
    try:
        weights = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - truncated, garbled, or refused by the weights-only unpickler
        raise UserError(f"{path}: not a readable model state_dict ({load_failure(e)}); "
                        "give the model.pt that distrib train wrote") from None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise UserError(f"{path}: not a model state_dict (a dict of tensors); give the model.pt that distrib train "
                        "wrote")
    return weights


def _read_safetensors(folder: Path) -> dict:
    if (folder / ADAPTER_CONFIG).is_file():  # an adapter run's: the whole wrapped state is model.pt's alone
        raise UserError(f"{folder}: the adapter alone (peft's format), and this run wrote no model.pt (the whole model "
                        "is written there under ddp, or up to 256 MiB); load it in Python: PeftModel.from_pretrained("
                        f"base, '{folder}'), or from_pretrained('{folder / 'merged'}')")
    try:
        return read_weights(folder)
    except Exception as e:  # noqa: BLE001 - a missing shard, a garbled header
        raise UserError(f"{folder}: not readable safetensors ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                        "give the weights/ that distrib train wrote, or its model.pt") from None


def rebuilt_model(trained: Trained, info: DataInfo) -> nn.Module:
    """The trained model, rebuilt from its config on the CPU and given its weights (model.pt, or weights/, which
    holds a tied weight once: its twin is filled in; a peft model's merged weights go into its base, merged)."""
    torch.manual_seed(trained.config.train.seed)  # as in training: non-persistent buffers (not in model.pt) match
    model = build_model(trained.config.model, info)
    if adapters.is_peft(model) and not any(adapters.is_adapter_name(model, name) for name in trained.weights):
        model = model.merge_and_unload()  # merged weights (weights/merged/) fill the base model, under its names
    weights = dict(trained.weights)
    for name, first in aliases_of(model).items():
        if name not in weights and first in weights:
            weights[name] = weights[first]
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise UserError(f"{trained.source}: its weights do not fit the model that the config builds ({first[:200]}); "
                        "give the config it was trained with (--config FILE, --set model.*)") from None
    return model


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
