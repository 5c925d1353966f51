"""A run's trained weights as safetensors, written shard by shard: every rank writes the slices it holds straight into
the final files (nothing is gathered), rank 0 the headers, the index and a Hugging Face model's config.json; which
block of a (DTensor) tensor a rank holds; and reading such a folder back whole (eval, predict, generate).

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
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from distrib.distributed.strategies import Strategy
from distrib.errors import EnvironmentFault, UserError

WEIGHTS_DIR, SINGLE, INDEX = "weights", "model.safetensors", "model.safetensors.index.json"
MAX_FILE_BYTES = 5 * 2**30  # model.max_shard_size's default (save_pretrained's max_shard_size)
# model.pt under a sharded strategy is gathered whole into rank 0's host memory: only up to this size, and up to one
# file of weights/, so that rank 0's save holds at most one file more than the other ranks.
MODEL_PT_MAX_BYTES = 256 * 2**20
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


# ---------------------------------------------------------------- which block of a tensor this rank holds


def local_block(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, sizes) of the block this rank holds: a DTensor's local shard (FSDP's rows, tensor
    parallel's columns, both, uneven ones included), or the whole of a plain tensor."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tuple(offsets), tuple(sizes)
    return (0,) * tensor.dim(), tuple(tensor.shape)


def block_slices(offsets, sizes) -> tuple[slice, ...]:
    return tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes))


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def writes_block(tensor: torch.Tensor, rank: int) -> bool:
    """Whether this rank writes its block: of the ranks holding the same block (replicas: hsdp's groups, tensor
    parallel's norms, a plain tensor on every rank) only the first."""
    if tensor.is_meta:  # another pipeline stage's: its own ranks write it
        return False
    if isinstance(tensor, DTensor):
        coordinate = tensor.device_mesh.get_coordinate() or []
        return all(coordinate[dim] == 0 for dim, placement in enumerate(tensor.placements)
                   if isinstance(placement, Replicate))
    return rank == 0


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


def _agree(error: str | None) -> None:
    """Every rank learns whether any rank failed (the first reason), so that none waits in the next collective."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = next((e for e in errors if e), None)
    if failed:
        raise EnvironmentFault(failed)


def _fault(folder: Path, e: OSError) -> str:
    return (f"{folder}: the weights cannot be written ({e.strerror}); free some space or fix the folder "
            "(permissions, a read-only mount), then run the same command again")


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
            error = _fault(folder, e)
    _agree(error)  # the files exist before any rank writes into them
    written, error = 0, None
    try:
        written = _write_blocks(tmp, files, tensors, rank)
    except OSError as e:
        error = _fault(folder, e)
    _agree(error)  # every block is written before rank 0 renames the folder
    if rank == 0:
        try:
            _finish(tmp, folder, files, config)
        except OSError as e:
            error = _fault(folder, e)
    _agree(error)
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


def write_run_weights(model: nn.Module, ema, run_dir: Path, rank: int, strategy: Strategy, init_from: str = "",
                      merged_weights: bool = True, log=lambda line: None, max_file_bytes: int = MAX_FILE_BYTES
                      ) -> list[str]:
    """Every rank: the unwrapped model's weights into run_dir/weights/ (and the EMA's into weights_ema/), shard by
    shard in files of at most max_file_bytes (the strategy's save of trained weights), checked by loading them back;
    a peft model's as its adapter and weights/merged/ (distrib.checkpoint.adapter_weights). Then, where
    model_pt_is_cheap, model.pt and model_ema.pt (the whole wrapped state, which the config's model takes back),
    written by rank 0 one at a time. Returns the names of those written (the same on every rank)."""
    from distrib.checkpoint import adapter_weights
    from distrib.checkpoint.export_check import agree_checked, check_folder, check_state_folder
    from distrib.models.adapters import is_peft

    tensors = strategy.complete(model, model_tensors(model))  # under pipeline parallel: every stage's names
    folder = Path(run_dir) / WEIGHTS_DIR
    if is_peft(model):
        adapter_weights.save_adapter_run(model, tensors, folder, rank, init_from, merged_weights, log, max_file_bytes)
    else:
        save_weights(tensors, folder, rank, hf_config(model), max_file_bytes)
        agree_checked(rank, lambda: check_folder(folder, model, tensors))
    if ema is not None:
        averaged, ema_folder = strategy.complete(model, ema.state_dict()), Path(run_dir) / f"{WEIGHTS_DIR}_ema"
        save_weights(averaged, ema_folder, rank, max_file_bytes=max_file_bytes)
        shapes = {name: tuple(tensor.shape) for name, tensor in averaged.items()}
        agree_checked(rank, lambda: check_state_folder(ema_folder, shapes))
    if not model_pt_is_cheap(tensors, strategy.sharded_state, max_file_bytes):
        return []
    whole = {"model.pt": lambda: strategy.full_model_state(model)}  # a sharded model is gathered onto rank 0
    if ema is not None:
        whole["model_ema.pt"] = lambda: strategy.whole_on_rank0(ema.full_state_dict())  # a gather under fsdp
    for name, gather in whole.items():
        _save_whole(gather, Path(run_dir) / name, rank)
    return list(whole)


def _save_whole(gather, path: Path, rank: int) -> None:
    """Every rank: gather() (a collective), and rank 0 writes what it returns to `path`, then lets it go before the
    next file is gathered: rank 0 never holds more than one whole file above the other ranks."""
    from distrib.checkpoint.format import save_atomic

    state, error = gather(), None
    if rank == 0:
        try:
            save_atomic(state, path)
        except EnvironmentFault as e:
            error = str(e)
    del state
    _agree(error)  # no rank goes on to the next gather while rank 0's write failed
