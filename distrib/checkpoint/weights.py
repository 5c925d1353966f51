"""A run's trained weights as safetensors, written shard by shard: every rank writes the slices it holds straight into
the final files (nothing is gathered), rank 0 the headers, the index and a Hugging Face model's config.json; and
reading such a folder back whole (eval, predict, generate). What a run writes at its end: checkpoint.run_weights.

    run.dir/weights/
        model.safetensors                       every tensor of the unwrapped state_dict (tied ones once), or, over
        model-00001-of-00003.safetensors ...    model.max_shard_size, several files and model.safetensors.index.json
        config.json                             a Hugging Face model's config, so from_pretrained(folder) works
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from distrib.checkpoint.blocks import local_block, local_part, writes_block
from distrib.checkpoint.weight_files import INDEX, MAX_FILE_BYTES, SINGLE, agree_write, write_fault
from distrib.errors import UserError

# model.pt under a sharded strategy is gathered whole into rank 0's host memory: only up to this size, and up to one
# file of weights/, so that rank 0's save holds at most one file more than the other ranks.
MODEL_PT_MAX_BYTES = 256 * 2**20
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


# ---------------------------------------------------------------- what a model's weights are


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state_dict (DTensor shards under fsdp, hsdp and tensor parallel), each tensor once: a
    tied weight (a Hugging Face lm_head sharing the embedding) keeps its first name, as save_pretrained does."""
    state = model.state_dict()  # FSDP2 reshards first: each rank's shards, never the gathered parameters
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    aliases = {n for n, _ in itertools.chain(model.named_parameters(remove_duplicate=False),
                                             model.named_buffers(remove_duplicate=False))} - names
    return {name: tensor for name, tensor in state.items() if name not in aliases}


def aliases_of(model: nn.Module) -> dict[str, str]:
    """Tied names -> the first name of the same tensor (lm_head.weight -> model.embed_tokens.weight)."""
    first: dict[int, str] = {}
    found = {}
    for name, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                        model.named_buffers(remove_duplicate=False)):
        found[name] = first.setdefault(id(tensor), name)
    return {name: to for name, to in found.items() if name != to}


# ---------------------------------------------------------------- the files' layout (the same on every rank)


def _header(entries: dict[str, dict]) -> bytes:
    """The safetensors header: its length (u64, little-endian), then JSON padded with spaces to 8 bytes."""
    text = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def layout(tensors: dict[str, torch.Tensor], max_file_bytes: int = MAX_FILE_BYTES) -> dict[str, dict]:
    """file name -> {"header": bytes, "at": {tensor name: absolute byte offset}, "size": bytes}: tensors in
    state_dict order, a new file whenever the next would pass max_file_bytes. Global shapes and dtypes only, so
    every rank computes the same layout without talking."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise UserError(f"weights: {name} is {tensor.dtype}, which safetensors cannot hold; keep it out of the "
                            "state_dict (a non-persistent buffer) or use another dtype")
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and used + nbytes > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    files = {}
    for number, names in enumerate(groups, start=1):
        entries, begin = {}, 0
        for name in names:
            tensor = tensors[name]
            end = begin + tensor.numel() * tensor.element_size()
            entries[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [begin, end]}
            begin = end
        header = _header(entries)
        file = SINGLE if len(groups) == 1 else f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        files[file] = {"header": header, "size": len(header) + begin,
                       "at": {name: len(header) + entry["data_offsets"][0] for name, entry in entries.items()}}
    return files


def byte_runs(offsets, sizes, shape, itemsize: int):
    """(file offset relative to the tensor's start, local byte offset, length) of each contiguous run of a block at
    `offsets` of `sizes` in a row-major tensor of `shape`: one run for FSDP's rows, one per row for column blocks."""
    partial = [dim for dim in range(len(shape)) if sizes[dim] != shape[dim]]
    if not partial:
        yield 0, 0, math.prod(shape) * itemsize
        return
    last = partial[-1]
    strides = [math.prod(shape[dim + 1:]) for dim in range(len(shape))]
    local_strides = [math.prod(sizes[dim + 1:]) for dim in range(len(sizes))]
    length = sizes[last] * strides[last]
    for index in itertools.product(*(range(size) for size in sizes[:last])):
        start = sum((offsets[dim] + i) * strides[dim] for dim, i in enumerate(index)) + offsets[last] * strides[last]
        local = sum(i * local_strides[dim] for dim, i in enumerate(index))
        yield start * itemsize, local * itemsize, length * itemsize


# ---------------------------------------------------------------- writing, every rank its own blocks


# A file being written: its header and size are final from the start, so safe_open would take it with the blocks not
# yet written as zeros. Under this suffix no loader picks it up (a *.safetensors glob, an index, from_pretrained).
PARTIAL = ".partial"


def _create(tmp: Path, files: dict[str, dict]) -> None:
    """Rank 0: each file with its header, sized to hold every tensor (sparse until the ranks write), as FILE.partial."""
    shutil.rmtree(tmp, ignore_errors=True)  # a write that died
    tmp.mkdir(parents=True)
    for file, spec in files.items():
        with open(tmp / (file + PARTIAL), "wb") as f:
            f.write(spec["header"])
            f.truncate(spec["size"])


def _write_blocks(tmp: Path, files: dict[str, dict], tensors: dict[str, torch.Tensor], rank: int) -> int:
    """This rank's blocks, each at its place in its file (pwrite: the ranks write disjoint bytes of one file);
    returns the bytes written. One block in host memory at a time."""
    written = 0
    for file, spec in files.items():
        mine = {name: at for name, at in spec["at"].items() if writes_block(tensors[name], rank)}
        if not mine:  # never touch a file (or, under ddp, the folder) this rank has no bytes for
            continue
        fd = os.open(tmp / (file + PARTIAL), os.O_WRONLY)
        try:
            for name, at in mine.items():
                tensor = tensors[name]
                offsets, sizes = local_block(tensor)
                data = local_part(tensor).detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
                for start, local, length in byte_runs(offsets, sizes, tuple(tensor.shape), tensor.element_size()):
                    os.pwrite(fd, memoryview(data)[local:local + length], at + start)
                    written += length
            os.fsync(fd)
        finally:
            os.close(fd)
    return written


def _finish(tmp: Path, folder: Path, files: dict[str, dict], config) -> None:
    """Rank 0, once every rank wrote: each file under its name, the index (several files), config.json, then the
    folder into place. A writer killed at any moment leaves no file a loader takes that is not complete."""
    for file in files:
        os.replace(tmp / (file + PARTIAL), tmp / file)
    if len(files) > 1:
        total = sum(spec["size"] - len(spec["header"]) for spec in files.values())
        weight_map = {name: file for file, spec in files.items() for name in spec["at"]}
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if config is not None:
        config.to_json_file(str(tmp / "config.json"))
    replace_folder(tmp, folder)


def replace_folder(tmp: Path, folder: Path) -> None:
    """Rank 0: the finished temporary folder into place, a run's earlier weights replaced whole, never mixed."""
    old = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def hf_config(model: nn.Module):
    """A Hugging Face model's config (it has to_json_file), with the model's class as its architecture; else None."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_file", None)):
        return None
    import copy

    from torch.distributed.fsdp import FSDPModule

    config = copy.deepcopy(config)  # the model's own class, not FSDP2's subclass of it (FSDPLlamaForCausalLM)
    own = getattr(model, "whole_class", None)  # under pipeline parallel, the class of the model the stages cut
    own = own or next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
    config.architectures = [own.__name__]
    return config


def save_weights(tensors: dict[str, torch.Tensor], folder: Path, rank: int, config=None,
                 max_file_bytes: int = MAX_FILE_BYTES) -> int:
    """Every rank: writes `tensors` (model_tensors(), plain or DTensor) as safetensors into `folder`, each rank the
    blocks it holds; config: a Hugging Face config for config.json. Written into a temporary folder that rank 0
    renames into place once all ranks are done. Returns the bytes this rank wrote."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    files = layout(tensors, max_file_bytes)
    error = None
    if rank == 0:
        try:
            _create(tmp, files)
        except OSError as e:
            error = write_fault(folder, e)
    agree_write(error)  # the files exist before any rank writes into them
    written, error = 0, None
    try:
        written = _write_blocks(tmp, files, tensors, rank)
    except OSError as e:
        error = write_fault(folder, e)
    agree_write(error)  # every block is written before rank 0 renames the folder
    if rank == 0:
        try:
            _finish(tmp, folder, files, config)
        except OSError as e:
            error = write_fault(folder, e)
    agree_write(error)
    return written


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The whole state_dict from a weights folder (or a .safetensors file), on the CPU."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if folder.is_file():
        return load_file(folder)
    index = folder / INDEX
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [SINGLE]
    return {name: tensor for file in files for name, tensor in load_file(folder / file).items()}


def model_pt_written(nbytes: int, sharded: bool, max_file_bytes: int = MAX_FILE_BYTES) -> bool:
    """model.pt costs nothing to gather under ddp (rank 0 holds the whole model); under the sharded strategies it
    is gathered into rank 0's host memory, so only for models of at most MODEL_PT_MAX_BYTES and one weights file."""
    return not sharded or nbytes <= min(MODEL_PT_MAX_BYTES, max_file_bytes)


def model_pt_is_cheap(tensors: dict[str, torch.Tensor], sharded: bool, max_file_bytes: int = MAX_FILE_BYTES) -> bool:
    """model_pt_written for these tensors (model_tensors: a tied one once)."""
    return model_pt_written(sum(t.numel() * t.element_size() for t in tensors.values()), sharded, max_file_bytes)
