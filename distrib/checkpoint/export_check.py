"""The export checks itself: once a run's weights are written, rank 0 opens them as a user would (the architecture
that config.json names, built on the meta device; peft's own loading of an adapter) and checks every name and shape,
reading headers only, so that no export loads as something else than what was trained."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.checkpoint.weight_files import ADAPTER_FILE
from distrib.errors import UserError


class ExportCheckError(RuntimeError):
    """Written weights that would not load as the trained model: distrib's bug, never the user's."""


def _bug(file, detail: str) -> ExportCheckError:
    return ExportCheckError(f"{file}: the exported weights would not load as the model that was trained ({detail}); "
                            "this is distrib's bug, not yours: please report it with this line (the run's checkpoints "
                            "hold the trained state)")


def agree_checked(rank: int, check) -> None:
    """Every rank (a collective): rank 0 runs check(), and every rank raises its ExportCheckError, so that none goes
    on to the next collective alone."""
    error = None
    if rank == 0:
        try:
            check()
        except ExportCheckError as e:
            error = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        said = [error]
        dist.broadcast_object_list(said, src=0)
        error = said[0]
    if error:
        raise ExportCheckError(error)


def architecture(folder: Path, trained: nn.Module) -> nn.Module | None:
    """What from_pretrained(folder) builds, on the meta device: the class that config.json's architectures names
    (transformers', else the trained model's own), from the config AutoConfig reads; None where that is no
    transformers model (a config.json beside a user's own nn.Module)."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(str(folder))
    except (ValueError, KeyError, OSError):  # a model_type transformers does not know: the model's own config reads it
        own = type(getattr(trained, "config", None))
        if not callable(getattr(own, "from_pretrained", None)):
            return None
        config = own.from_pretrained(str(folder))
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None and names and names[0] == type(trained).__name__:
        cls = type(trained)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        return None
    with torch.device("meta"):
        return cls(config)


def check_pretrained_folder(folder: Path, model: nn.Module) -> None:
    """A folder with config.json, against the architecture it names (built on meta): every one of its tensors in
    the folder's safetensors, each of its shape (init_from's strict check), and nothing it does not take."""
    from distrib.checkpoint.init_from import check_weights, open_source

    try:
        pretrained = check_weights(model, open_source(str(folder)))
    except UserError as e:  # its text speaks of model.init_from; keep what did not fit
        found = re.search(r"do not fit the model, (.*?); give", str(e))
        raise _bug(folder, found.group(1) if found else str(e)) from None
    if pretrained.left_out:
        raise _bug(folder, f"{len(pretrained.left_out)} unexpected (first {pretrained.left_out[0]})")


def check_folder(folder: Path, model: nn.Module, written: dict[str, torch.Tensor]) -> None:
    """Rank 0: a weights folder as its user loads it: from_pretrained's architecture (config.json's), else the
    state_dict's names and shapes as written."""
    built = architecture(folder, model) if (folder / "config.json").is_file() else None
    if built is not None:
        check_pretrained_folder(folder, built)
    else:
        check_state_folder(folder, {name: tuple(tensor.shape) for name, tensor in written.items()})


def check_state_folder(folder: Path, expected: dict[str, tuple]) -> None:
    """A folder of a state_dict without config.json: its names and shapes are exactly the ones written."""
    from distrib.checkpoint.init_from import open_source

    _compare(folder, open_source(str(folder)).shapes, expected)


def _compare(file, found: dict[str, tuple], expected: dict[str, tuple]) -> None:
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    misshaped = [name for name in expected if name in found and tuple(found[name]) != tuple(expected[name])]
    if missing or unexpected or misshaped:
        first = (f"{len(missing)} missing (first {missing[0]})" if missing else
                 f"{len(unexpected)} unexpected (first {unexpected[0]})" if unexpected else
                 f"{len(misshaped)} mis-shaped (first {misshaped[0]}: {list(found[misshaped[0]])} in the file, "
                 f"{list(expected[misshaped[0]])} in the model)")
        raise _bug(file, first)


class _Recording:
    """The PeftModel as set_peft_model_state_dict sees it, but its load_state_dict records what it was given and
    loads nothing: what peft would take from an adapter file, mapped by peft's own code."""

    def __init__(self, model: nn.Module):
        self._model, self.taken = model, {}

    def __getattr__(self, name):
        return getattr(self._model, name)

    def load_state_dict(self, state, strict=True, assign=False):
        self.taken = dict(state)


def check_adapter_folder(folder: Path, model: nn.Module, adapter: str) -> None:
    """An adapter folder: peft's set_peft_model_state_dict maps the file's names onto exactly this model's tensors of
    `adapter`, each of its shape (meta tensors of the file's header shapes stand in for the data)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors import safe_open

    from distrib.models.adapters import is_adapter_name

    file = folder / ADAPTER_FILE
    with safe_open(str(file), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    if model.peft_config[adapter].is_prompt_learning:  # peft loads its prompt encoder itself: compare with its save
        from peft.utils import get_peft_model_state_dict

        saved = get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False)
        return _compare(file, shapes, {name: tuple(tensor.shape) for name, tensor in saved.items()})
    recording = _Recording(model)
    set_peft_model_state_dict(recording, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()},
                              adapter_name=adapter)
    state = model.state_dict()
    expected = {name: tuple(tensor.shape) for name, tensor in state.items()
                if is_adapter_name(model, name) and f".{adapter}." in f"{name}."}
    _compare(file, {name: tuple(tensor.shape) for name, tensor in recording.taken.items()}, expected)
