"""model.init_from: pretrained weights into a built model, each rank reading only the blocks it holds (safetensors and
torch files memory-mapped and sliced; a sharded distrib checkpoint through dcp.load), after a strict check of names
and shapes that runs before anything is written.

What it reads: a Hugging Face folder or file of safetensors (one file, or several with model.safetensors.index.json);
a distrib run's weights (RUN_DIR/weights/, RUN_DIR/model.pt, or the run directory itself: weights/ first); a distrib
checkpoint (a one-file step_N.pt, or a sharded step_N/ directory).

The four steps the worker calls: open_source finds which kind of weights a path holds (pretrained_sources reads
each kind), check_weights matches their names and shapes to the model's (pretrained_names), load_weights reads each
rank's blocks, clear_weights stands in for them on a resumed run."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.checkpoint import hf_conversion
from distrib.checkpoint.blocks import local_part
from distrib.checkpoint.pretrained_names import Pretrained, base_view, ignored, misfit, other_stages, rename, renaming
from distrib.checkpoint.pretrained_sources import (
    DcpCheckpoint,
    Safetensors,
    nbytes,
    refuse,
    safetensors_files,
    torch_file,
)
from distrib.checkpoint.weight_files import INDEX, WEIGHTS_DIR
from distrib.checkpoint.weights import aliases_of


def open_source(path: str):
    """The weights at `path`, their names and shapes read (headers, metadata, a memory map), no tensor data."""
    where = Path(path)
    if where.is_dir() and (where / WEIGHTS_DIR).is_dir():
        where = where / WEIGHTS_DIR  # a distrib run directory: its safetensors, which read in slices
    if where.is_file():
        return Safetensors(where, [where]) if where.suffix == ".safetensors" else torch_file(where)
    if not where.is_dir():
        raise refuse(path, "no such file or folder")
    if (where / ".metadata").is_file():
        return DcpCheckpoint(where)
    files = safetensors_files(where)
    if files:
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise refuse(path, f"{missing[0]} is missing (named by {INDEX})")
        return Safetensors(where, files)
    if (where / "model.pt").is_file():
        return torch_file(where / "model.pt")
    raise refuse(path, "a folder without .safetensors files, model.pt or a sharded checkpoint's .metadata")


def check_weights(model: nn.Module, source) -> Pretrained:
    """The model's names and shapes (any device, meta included) against the source's, strictly: every tensor of
    the model's state_dict found (a tied one through its twin), none left over, each of the same shape. A peft
    adapter's base model is checked against them, and the adapter's own tensors are kept. Under pipeline parallel
    the whole model's are checked, and this rank's stages' are read."""
    named, view, kept = base_view(model)
    state = model.state_dict()
    expected = {base: tuple(state[name].shape) for base, name in view.items()}
    expected.update(other_stages(model, state))  # read by the ranks of the stages that hold them
    source = hf_conversion.converted(named, source, set(expected))  # a Hub layout: as from_pretrained converts it
    base = getattr(named, "base_model_prefix", "") or ""
    prefix, how = renaming(set(expected), source.shapes, base)
    names, unexpected, left_out = {}, [], []
    for original in source.shapes:
        name = rename(original, prefix, how)
        if name in expected:
            names[name] = original
        elif name is None and prefix == base + ".":
            left_out.append(original)  # from_pretrained's convention too: a base model drops the head
        elif not ignored(named, "unexpected", original):
            unexpected.append(original)
    tied = aliases_of(named)
    twins: dict[str, set[str]] = {}
    for name, first in tied.items():
        twins.setdefault(first, {first}).add(name)
    missing = [name for name in expected if not (twins.get(tied.get(name, name), {name}) & names.keys())
               and not ignored(named, "missing", name)]
    misshaped = [(name, source.shapes[original], expected[name]) for name, original in names.items()
                 if tuple(source.shapes[original]) != expected[name]]
    if missing or unexpected or misshaped:
        raise misfit(source.path, missing, unexpected, misshaped)
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
    whole = sum(nbytes(tensor.shape, tensor) for tensor in targets.values())
    if targets:  # under pipeline parallel, the other stages' tensors too, in this stage's dtype: the whole model
        whole += sum(nbytes(shape, next(iter(targets.values()))) for shape in other_stages(model, state).values())
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

