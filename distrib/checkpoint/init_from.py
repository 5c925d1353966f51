"""model.init_from: pretrained weights into a built model, each rank reading only the blocks it holds (safetensors and
torch files memory-mapped and sliced; a sharded distrib checkpoint through dcp.load), after a strict check of names
and shapes that runs before anything is written.

What it reads: a Hugging Face folder or file of safetensors (one file, or several with model.safetensors.index.json);
a distrib run's weights (RUN_DIR/weights/, RUN_DIR/model.pt, or the run directory itself: weights/ first); a distrib
checkpoint (a one-file step_N.pt, or a sharded step_N/ directory)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.checkpoint import hf_conversion
from distrib.checkpoint.blocks import block_slices, local_block, local_part
from distrib.checkpoint.format import FORMAT
from distrib.checkpoint.weight_files import INDEX, SINGLE, WEIGHTS_DIR
from distrib.checkpoint.weights import aliases_of
from distrib.errors import UserError
from distrib.models import adapters

_FIX = ("give a Hugging Face folder or .safetensors file, a distrib run directory (its weights/ or model.pt), or a "
        "distrib checkpoint (step_N.pt or a sharded step_N/)")


def _refuse(path, why: str) -> UserError:
    return UserError(f"model.init_from = {str(path)!r}: {why}; {_FIX}")


def _unreadable(path, file, kind: str, error: Exception) -> UserError:
    """A weights file that exists but cannot be read (truncated, a few bytes, not of its format): every rank that
    reads it says this one line, naming the file."""
    reason = " ".join(str(error).split())[:300] or "no reason given"
    return UserError(f"model.init_from = {str(path)!r}: {file} is not a readable {kind} ({type(error).__name__}: "
                     f"{reason}); it is damaged or incomplete (a download or copy cut short?): copy or download it "
                     "again, or give another model.init_from")


# ---------------------------------------------------------------- the sources


class Safetensors:
    """Safetensors files: names and shapes from their headers; a block read through get_slice (memory-mapped, so
    only its bytes are read)."""

    kind = "safetensors"

    def __init__(self, path: Path, files: list[Path]):
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError:
            raise _refuse(path, "safetensors files, and the safetensors package is not installed (pip install "
                                "safetensors)") from None

        self.path, self.handles, self.shapes = path, {}, {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")  # checks the header against the file's size
                for name in handle.keys():
                    self.handles[name] = handle
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())
            except (SafetensorError, OSError) as e:
                raise _unreadable(path, file, "safetensors file", e) from None

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        part = self.handles[name].get_slice(name)
        return part[slices] if slices else self.handles[name].get_tensor(name)

    def load(self, targets: dict[str, torch.Tensor]) -> int:
        read = _copy_blocks(self, targets)
        self.handles = {}  # unmapped: the pages read would otherwise stay in this process's resident memory
        return read


class TorchFile:
    """A torch.save'd state_dict (model.pt) or a one-file distrib checkpoint's model, memory-mapped: slicing a block
    touches only its pages."""

    kind = "torch file"

    def __init__(self, path: Path, state: dict[str, torch.Tensor]):
        self.path, self.state = path, state
        self.shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        return self.state[name][slices]

    def load(self, targets: dict[str, torch.Tensor]) -> int:
        read = _copy_blocks(self, targets)
        self.state = {}  # unmapped, as above
        return read


class DcpCheckpoint:
    """A sharded distrib checkpoint (torch.distributed.checkpoint): names and shapes from its .metadata; dcp.load
    reads each rank's blocks (resharded to any layout). A collective."""

    kind = "sharded checkpoint"

    def __init__(self, path: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        try:
            metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 - a pickle: truncated or garbled, any unpickling error
            raise _unreadable(path, path / ".metadata", "sharded checkpoint's metadata", e) from None
        self.shapes = {key[len("model."):]: tuple(value.size) for key, value in metadata.items()
                       if key.startswith("model.") and isinstance(value, TensorStorageMetadata)}

    def load(self, targets: dict[str, torch.Tensor]) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:  # DCP reads this rank's blocks (those of the plan) and tells every rank of any rank's failure
            dcp.load({"model": targets}, checkpoint_id=self.path)
        except CheckpointException as e:  # its text is every failed rank's traceback: name the first one's error
            rank, (error, _) = next(iter(sorted(e.failures.items())))
            raise _unreadable(self.path, self.path, f"sharded checkpoint (on rank {rank})", error) from None
        return sum(_nbytes(sizes, targets[name]) for name, (_, sizes) in read_plan(targets).items())


def _copy_blocks(source, targets: dict[str, torch.Tensor]) -> int:
    """Each target's block of the plan, read and copied into this rank's part; returns the bytes read (counted on
    what the source handed over, in the file's dtype)."""
    read = 0
    with torch.no_grad():
        for name, (offsets, sizes) in read_plan(targets).items():
            part = local_part(targets[name])
            if part.numel():
                block = source.read(name, block_slices(offsets, sizes))
                part.copy_(block)
                read += block.numel() * block.element_size()
    return read


def read_plan(targets: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Source name -> (offsets, sizes) of the block this rank reads: its own shard of a DTensor, the whole of a
    plain tensor (ddp, buffers)."""
    return {name: local_block(tensor) for name, tensor in targets.items()}


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise _refuse(folder, f"{INDEX} is unreadable ({type(e).__name__}: {e})") from None
        return [folder / name for name in names]
    return [folder / SINGLE] if (folder / SINGLE).is_file() else sorted(folder.glob("*.safetensors"))


def _torch_file(path: Path) -> TorchFile:
    try:
        state = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - not a zip file, garbled, refused by the weights-only unpickler
        raise _refuse(path, f"not readable as safetensors or a torch file ({type(e).__name__})") from None
    if isinstance(state, dict) and state.get("format") == FORMAT:
        state = state.get("model")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise _refuse(path, "a torch file, but not a state_dict (a dict of tensors) or a distrib checkpoint")
    return TorchFile(path, state)


def open_source(path: str):
    """The weights at `path`, their names and shapes read (headers, metadata, a memory map), no tensor data."""
    where = Path(path)
    if where.is_dir() and (where / WEIGHTS_DIR).is_dir():
        where = where / WEIGHTS_DIR  # a distrib run directory: its safetensors, which read in slices
    if where.is_file():
        return Safetensors(where, [where]) if where.suffix == ".safetensors" else _torch_file(where)
    if not where.is_dir():
        raise _refuse(path, "no such file or folder")
    if (where / ".metadata").is_file():
        return DcpCheckpoint(where)
    files = _safetensors_files(where)
    if files:
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise _refuse(path, f"{missing[0]} is missing (named by {INDEX})")
        return Safetensors(where, files)
    if (where / "model.pt").is_file():
        return _torch_file(where / "model.pt")
    raise _refuse(path, "a folder without .safetensors files, model.pt or a sharded checkpoint's .metadata")


# ---------------------------------------------------------------- names and shapes, strictly


@dataclass(frozen=True)
class Pretrained:
    """Weights checked against a model: which of the source's names goes into which of the model's."""

    source: object  # Safetensors | TorchFile | DcpCheckpoint
    names: dict[str, str]  # model name -> source name
    renamed: str = ""  # how the names were matched, when not as they are
    left_out: list[str] = field(default_factory=list)  # a head the model does not have (a base model from a full one)
    kept: list[str] = field(default_factory=list)  # an adapter's tensors, not in base weights: their own init


def _rename(name: str, prefix: str, how: str) -> str | None:
    if how == "add":
        return prefix + name
    return name[len(prefix):] if name.startswith(prefix) else None


def _renaming(expected: set[str], names, base: str) -> tuple[str, str]:
    """(prefix, strip | add), the empty prefix for names as they are: the Hugging Face conventions (a base
    model's weights inside a model with a head are under base_model_prefix), and DDP's or torch.compile's prefix on
    a state_dict saved from the wrapper; the one that matches the most names, as they are on a tie."""
    options = [("", "strip"), ("module.", "strip"), ("_orig_mod.", "strip")]
    options += [(base + ".", "strip"), (base + ".", "add")] if base else []
    return max(options, key=lambda option: sum(_rename(n, *option) in expected for n in names))


def _ignored(model: nn.Module, kind: str, name: str) -> bool:
    """Names a Hugging Face model declares it may miss or not know (_keys_to_ignore_on_load_missing, ...)."""
    patterns = getattr(model, f"_keys_to_ignore_on_load_{kind}", None) or ()
    return any(re.search(pattern, name) for pattern in patterns)


def _misfit(path, missing: list[str], unexpected: list[str], misshaped: list[tuple]) -> UserError:
    parts = [f"{len(missing)} missing (first {missing[0]})" if missing else "",
             f"{len(unexpected)} unexpected (first {unexpected[0]})" if unexpected else "",
             (f"{len(misshaped)} mis-shaped (first {misshaped[0][0]}: {list(misshaped[0][1])} in the weights, "
              f"{list(misshaped[0][2])} in the model)") if misshaped else ""]
    return UserError(f"model.init_from = {str(path)!r}: the weights do not fit the model, "
                     f"{'; '.join(p for p in parts if p)}; give the weights of this model (the same architecture and "
                     "sizes), or build the model they were saved from (model.name, model.factory, model.kwargs)")


def _base_view(model: nn.Module) -> tuple[nn.Module, dict[str, str], list[str]]:
    """(the model whose names weights are saved under, {its name: the model's name}, the model's adapter tensors):
    the model itself, or for a peft adapter the base model inside it, whose weights fill the wrapped layers."""
    names = list(model.state_dict())
    if not adapters.is_peft(model):
        return model, {name: name for name in names}, []
    view = {adapters.base_name(model, name): name for name in names}
    return adapters.base_model(model), {base: name for base, name in view.items() if base is not None}, \
        [name for name in names if adapters.base_name(model, name) is None]


def _other_stages(model: nn.Module, state: dict) -> dict[str, tuple]:
    """Under pipeline parallel (one rank's stages, a Pipelined view: distrib.distributed.pipeline) the names and
    shapes of the whole model's tensors this rank does not hold: the rest of a weights file, which the other stages'
    ranks read. Every rank checks them all, so that all reach the same verdict before the collective load."""
    whole = getattr(getattr(model, "pipeline", None), "whole", None)
    if whole is None:
        return {}
    return {name: tuple(tensor.shape) for name, tensor in whole.state_dict().items() if name not in state}


def check_weights(model: nn.Module, source) -> Pretrained:
    """The model's names and shapes (any device, meta included) against the source's, strictly: every tensor of
    the model's state_dict found (a tied one through its twin), none left over, each of the same shape. A peft
    adapter's base model is checked against them, and the adapter's own tensors are kept. Under pipeline parallel
    the whole model's are checked, and this rank's stages' are read."""
    named, view, kept = _base_view(model)
    state = model.state_dict()
    expected = {base: tuple(state[name].shape) for base, name in view.items()}
    expected.update(_other_stages(model, state))  # read by the ranks of the stages that hold them
    source = hf_conversion.converted(named, source, set(expected))  # a Hub layout: as from_pretrained converts it
    base = getattr(named, "base_model_prefix", "") or ""
    prefix, how = _renaming(set(expected), source.shapes, base)
    names, unexpected, left_out = {}, [], []
    for original in source.shapes:
        name = _rename(original, prefix, how)
        if name in expected:
            names[name] = original
        elif name is None and prefix == base + ".":
            left_out.append(original)  # from_pretrained's convention too: a base model drops the head
        elif not _ignored(named, "unexpected", original):
            unexpected.append(original)
    tied = aliases_of(named)
    twins: dict[str, set[str]] = {}
    for name, first in tied.items():
        twins.setdefault(first, {first}).add(name)
    missing = [name for name in expected if not (twins.get(tied.get(name, name), {name}) & names.keys())
               and not _ignored(named, "missing", name)]
    misshaped = [(name, source.shapes[original], expected[name]) for name, original in names.items()
                 if tuple(source.shapes[original]) != expected[name]]
    if missing or unexpected or misshaped:
        raise _misfit(source.path, missing, unexpected, misshaped)
    renamed = "" if not prefix else f", names {'without' if how == 'strip' else 'with'} the prefix {prefix}"
    return Pretrained(source, {view[name]: original for name, original in names.items() if name in view}, renamed,
                      left_out, kept)


def load_weights(model: nn.Module, pretrained: Pretrained) -> str:
    """Every rank (a collective): reads its blocks of the checked weights into the built model in place (DTensor
    shards under fsdp, hsdp and tensor parallel; whole tensors under ddp). Returns the log line: what was read, and
    how many bytes each rank read (of the whole, in the model's dtype)."""
    state = model.state_dict()
    targets = {original: state[name] for name, original in pretrained.names.items()}
    mine = pretrained.source.load(targets)
    whole = sum(_nbytes(tensor.shape, tensor) for tensor in targets.values())
    if targets:  # under pipeline parallel, the other stages' tensors too, in this stage's dtype: the whole model
        whole += sum(_nbytes(shape, next(iter(targets.values()))) for shape in _other_stages(model, state).values())
    per_rank = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        per_rank = [0] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
    left_out = f"; left out, not in this model: {', '.join(pretrained.left_out[:3])}" if pretrained.left_out else ""
    if pretrained.kept:
        left_out += (f"; the adapter's {len(pretrained.kept)} tensors ({pretrained.kept[0]}, ...) are not in base "
                     "weights: they keep the adapter's own initialisation")
    return (f"model.init_from {pretrained.source.path} ({pretrained.source.kind}, {len(targets)} tensors"
            f"{pretrained.renamed}): each rank read {', '.join(f'{b / 2**20:.2f}' for b in per_rank)} MiB of "
            f"{whole / 2**20:.2f} MiB{left_out}")


def clear_weights(model: nn.Module) -> None:
    """Every rank: the model's state (parameters and persistent buffers; its local shards) as zeros, in place of
    model.init_from's weights on a run that resumes a checkpoint, which is loaded over them: the file is not read.
    Zeros, not the uninitialised memory of a materialised shard, so the checks before the resume run on numbers."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            local_part(tensor).zero_()


def _nbytes(shape, tensor: torch.Tensor) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * tensor.element_size()
