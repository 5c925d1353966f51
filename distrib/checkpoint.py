"""Checkpoints: complete training state written atomically by rank 0, verified by checksum, loaded safely,
and chosen once by rank 0 for every rank on resume (the newest good one, falling back past broken ones)."""

from __future__ import annotations

import hashlib
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from distrib.errors import UserError
from distrib.runtime import Runtime

FORMAT, VERSION = "distrib.checkpoint", 1
_NAME = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used: the message names the file and the reason."""


# ---------------------------------------------------------------- atomic files


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(obj, path: Path) -> Path:
    """torch.save to a temp file in the same directory, fsync, rename into place, fsync the directory: a crash at
    any moment leaves either the old file or the new one under `path`, never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return path


# ---------------------------------------------------------------- checksum and verified loads


def _feed(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(b"{")
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[" if isinstance(obj, list) else b"(")
        for value in obj:
            _feed(h, value)
        h.update(b"]")
    else:
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def digest(state: dict) -> str:
    """sha256 over every tensor's bytes and every other value, in order; the checksum field itself excluded."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "checksum"})
    return h.hexdigest()


def read_checkpoint(path: Path, device: torch.device) -> dict:
    """Loads with weights_only=True (never anything unsafe) onto `device`, then checks format and checksum."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            raise CheckpointError(f"checkpoint {path}: empty file (0 bytes)")
        state = torch.load(path, weights_only=True, map_location=device)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no such file; give an existing path or checkpoint.resume=auto")
    except Exception as e:  # noqa: BLE001 - truncated, garbled, or refused by the weights-only unpickler
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path}: unreadable or unsafe ({type(e).__name__}: {reason[:200]})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not a distrib checkpoint (no format={FORMAT!r} field)")
    if state.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {state.get('version')}, this distrib reads {VERSION}")
    if state.get("checksum") != digest(state):
        raise CheckpointError(f"checkpoint {path}: checksum mismatch, the file is corrupt")
    return state


# ---------------------------------------------------------------- the checkpoint directory


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (temp files never match the name), newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name)), reverse=True)


def _prune(directory: Path, keep_last: int) -> None:
    for old in list_checkpoints(directory)[keep_last:]:
        old.unlink(missing_ok=True)
    for stale in Path(directory).glob(".step_*.tmp"):  # rank 0 is the only writer: these are from killed runs
        stale.unlink(missing_ok=True)


def _newest_good(directory: Path, device: torch.device, say: Callable[[str], None]) -> tuple[Path | None, dict | None]:
    for path in list_checkpoints(directory):
        try:
            return path, read_checkpoint(path, device)
        except CheckpointError as e:
            say(f"{e}; falling back to the previous checkpoint")
    return None, None


def _choose(resume: str, directory: Path, device: torch.device, say) -> tuple[Path | None, dict | None]:
    if resume == "never":
        return None, None
    if resume == "auto":
        return _newest_good(directory, device, say)
    return Path(resume), read_checkpoint(Path(resume), device)


def load_for_resume(resume: str, directory: Path, runtime: Runtime, say: Callable[[str], None]) -> dict | None:
    """Rank 0 picks the checkpoint and broadcasts its choice; each rank loads it; all check they hold one step."""
    path, state, error = None, None, None
    if runtime.is_main:
        try:
            path, state = _choose(resume, directory, runtime.device, say)
        except CheckpointError as e:
            error = str(e)
    choice = [str(path) if path else None, error]
    dist.broadcast_object_list(choice, src=0)  # every rank takes part: this is also where the others wait
    if choice[1]:
        raise CheckpointError(choice[1])
    if choice[0] and state is None:
        state = read_checkpoint(Path(choice[0]), runtime.device)
    steps = [None] * runtime.world_size
    dist.all_gather_object(steps, state["progress"]["step"] if state else -1)
    if len(set(steps)) != 1:
        raise CheckpointError(f"checkpoint {choice[0]}: ranks loaded different steps {steps}; "
                              "checkpoint.dir must be one directory shared by every node")
    return state


# ---------------------------------------------------------------- random number generators


def rng_state(runtime: Runtime) -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "device": runtime.device_rng_state()}


def set_rng_state(state: dict, runtime: Runtime) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    runtime.set_device_rng_state(state["device"])


@dataclass
class Checkpointer:
    """Saves the state that `collect` returns, plus every rank's RNG states, every `every_steps` steps."""

    directory: Path
    every_steps: int
    keep_last: int
    runtime: Runtime
    collect: Callable[[], dict]

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, step: int, path: Path | None = None) -> Path:
        """Called by every rank: gathers the RNG states, rank 0 writes, all pass a barrier after the rename.
        `path` (a best_*.pt of distrib.best) names another file of the same format, which keep_last never prunes."""
        states = [None] * self.runtime.world_size
        dist.all_gather_object(states, rng_state(self.runtime))
        periodic = path is None
        path = checkpoint_path(self.directory, step) if periodic else Path(path)
        if self.runtime.is_main:
            state = {"format": FORMAT, "version": VERSION, **self.collect(), "rng": states}
            state["checksum"] = digest(state)
            save_atomic(state, path)
            if periodic:
                _prune(self.directory, self.keep_last)  # only now: the new checkpoint is safely in place
        dist.barrier()  # nobody moves on (or exits) before the checkpoint is on disk
        return path

    def load(self, resume: str, say: Callable[[str], None]) -> dict | None:
        return load_for_resume(resume, self.directory, self.runtime, say)


# Keys whose change makes a resumed run a different optimisation (another model, data stream or batch).
RESUME_KEYS = ("model.name", "model.factory", "data.name", "train.global_batch_size", "train.seed", "train.optimizer")


def check_compatible(path: str, saved: dict, current: dict, allow_change: bool) -> list[str]:
    """The RESUME_KEYS that differ, as 'key: old -> new'; an error unless the user allowed the change."""
    changed = [f"{key}: {_get(saved, key)!r} -> {_get(current, key)!r}" for key in RESUME_KEYS
               if _get(saved, key) != _get(current, key)]
    if changed and not allow_change:
        raise CheckpointError(f"checkpoint {path}: this run changes {'; '.join(changed)}, which breaks an exact "
                              "resume; restore the old values, use a new checkpoint.dir, or "
                              "--set checkpoint.allow_config_change=true")
    return changed


def _get(tree: dict, dotted: str):
    section, key = dotted.split(".")
    return tree.get(section, {}).get(key)
