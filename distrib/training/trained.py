"""A trained model read on the CPU (a run directory, a folder of safetensors as the model itself, a checkpoint file)
and rebuilt from its config with those weights, for distrib eval, predict and generate."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from distrib.checkpoint.format import list_checkpoints, load_failure, read_checkpoint
from distrib.checkpoint.weight_files import INDEX, SINGLE, WEIGHTS_DIR
from distrib.checkpoint.weights import aliases_of, read_weights
from distrib.config import Config, load_config
from distrib.data import DataInfo
from distrib.errors import UserError
from distrib.models import adapters
from distrib.models.build import build_model

ADAPTER_CONFIG = "adapter_config.json"  # peft's: a folder of an adapter alone

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
