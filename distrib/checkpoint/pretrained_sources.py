"""The kinds of pretrained weights model.init_from reads, each giving names and shapes without tensor data, then each
rank's blocks: safetensors (memory-mapped, sliced), a torch file (memory-mapped), a sharded distrib checkpoint
(dcp.load, resharded to any layout). And the one-line errors for a path that is none of them, or is damaged."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distrib.checkpoint.blocks import block_slices, local_block, local_part
from distrib.checkpoint.format import FORMAT
from distrib.checkpoint.weight_files import INDEX, SINGLE
from distrib.errors import UserError

_FIX = ("give a Hugging Face folder or .safetensors file, a distrib run directory (its weights/ or model.pt), or a "
        "distrib checkpoint (step_N.pt or a sharded step_N/)")


def refuse(path, why: str) -> UserError:
    return UserError(f"model.init_from = {str(path)!r}: {why}; {_FIX}")


def unreadable(path, file, kind: str, error: Exception) -> UserError:
    """A weights file that exists but cannot be read (truncated, a few bytes, not of its format): every rank that
    reads it says this one line, naming the file."""
    reason = " ".join(str(error).split())[:300] or "no reason given"
    return UserError(f"model.init_from = {str(path)!r}: {file} is not a readable {kind} ({type(error).__name__}: "
                     f"{reason}); it is damaged or incomplete (a download or copy cut short?): copy or download it "
                     "again, or give another model.init_from")


class Safetensors:
    """Safetensors files: names and shapes from their headers; a block read through get_slice (memory-mapped, so
    only its bytes are read)."""

    kind = "safetensors"

    def __init__(self, path: Path, files: list[Path]):
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError:
            raise refuse(path, "safetensors files, and the safetensors package is not installed (pip install "
                                "safetensors)") from None

        self.path, self.handles, self.shapes = path, {}, {}
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")  # checks the header against the file's size
                for name in handle.keys():
                    self.handles[name] = handle
                    self.shapes[name] = tuple(handle.get_slice(name).get_shape())
            except (SafetensorError, OSError) as e:
                raise unreadable(path, file, "safetensors file", e) from None

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
            raise unreadable(path, path / ".metadata", "sharded checkpoint's metadata", e) from None
        self.shapes = {key[len("model."):]: tuple(value.size) for key, value in metadata.items()
                       if key.startswith("model.") and isinstance(value, TensorStorageMetadata)}

    def load(self, targets: dict[str, torch.Tensor]) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:  # DCP reads this rank's blocks (those of the plan) and tells every rank of any rank's failure
            dcp.load({"model": targets}, checkpoint_id=self.path)
        except CheckpointException as e:  # its text is every failed rank's traceback: name the first one's error
            rank, (error, _) = next(iter(sorted(e.failures.items())))
            raise unreadable(self.path, self.path, f"sharded checkpoint (on rank {rank})", error) from None
        return sum(nbytes(sizes, targets[name]) for name, (_, sizes) in read_plan(targets).items())


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


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise refuse(folder, f"{INDEX} is unreadable ({type(e).__name__}: {e})") from None
        return [folder / name for name in names]
    return [folder / SINGLE] if (folder / SINGLE).is_file() else sorted(folder.glob("*.safetensors"))


def torch_file(path: Path) -> TorchFile:
    try:
        state = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - not a zip file, garbled, refused by the weights-only unpickler
        raise refuse(path, f"not readable as safetensors or a torch file ({type(e).__name__})") from None
    if isinstance(state, dict) and state.get("format") == FORMAT:
        state = state.get("model")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise refuse(path, "a torch file, but not a state_dict (a dict of tensors) or a distrib checkpoint")
    return TorchFile(path, state)


def nbytes(shape, tensor: torch.Tensor) -> int:
    """The bytes of a tensor of this shape in tensor's dtype."""
    count = 1
    for size in shape:
        count *= size
    return count * tensor.element_size()
