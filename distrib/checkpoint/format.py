"""Checkpoints: complete training state written atomically by rank 0, verified by checksum, loaded safely,
and chosen once by rank 0 for every rank on resume (the newest good one of the run that owns the folder).

Each checkpoint carries its run's id (a resumed run keeps it); pruning deletes only this run's older checkpoints."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from distrib.distributed.runtime import Runtime
from distrib.errors import EnvironmentFault, UserError

FORMAT, VERSION = "distrib.checkpoint", 1
_NAME = re.compile(r"^step_(\d{8})\.pt$")
OWNER_NAME = ".distrib-run"  # in checkpoint.dir: the id of the run whose checkpoints resume=auto continues


class CheckpointError(UserError):
    """A checkpoint that cannot be used: the message names the file and the reason."""


# ---------------------------------------------------------------- atomic files


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(obj, path: Path, tag: str = "") -> Path:
    """torch.save to a temp file in the same directory, fsync, rename into place, fsync the directory: a crash at
    any moment leaves either the old file or the new one under `path`, never a partial one. A full disk or an
    unwritable folder is an EnvironmentFault that says how much space the file needs; the old file stays."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{tag + '.' if tag else ''}{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)  # first: its space counts as free below
        # torch's zip writer turns ENOSPC into a RuntimeError ("unexpected pos ..."): the free space tells.
        full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) or _free(path) < _nbytes(obj)
        if not (full or isinstance(e, OSError)):
            raise
        raise EnvironmentFault(_write_fault(path, obj, e if not full else None)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _free(path: Path) -> int:
    return shutil.disk_usage(path.parent).free if path.parent.is_dir() else 0


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _write_fault(path: Path, obj, e: OSError | None) -> str:
    """e: the OSError of a write that failed for another reason than space; None for a full disk."""
    if e is None:
        return (f"{path}: no space left on the device: this file needs about {_nbytes(obj) / 1e6:.1f} MB, "
                f"{_free(path) / 1e6:.1f} MB are free; the earlier files are kept; free some space or move the folder "
                "to a larger disk, then run the same command again")
    return f"{path}: cannot be written ({e.strerror}); fix the folder (permissions, a read-only mount) or move it"


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


def load_failure(error: BaseException) -> str:
    """Why torch.load failed, in one line. A file the weights-only unpickler refused would run code when unpickled:
    say so and give the unpickler's own reason, never torch's hint to retry with weights_only=False."""
    text = " ".join(str(error).split())
    unpickler = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation|$)", text)
    if unpickler and "Unsupported global" in unpickler.group(1):
        return (f"unsafe: the weights-only unpickler refused it ({unpickler.group(1).strip()}); it names code, not "
                "just tensors: do not load it unless you trust its source and know what it runs")
    if unpickler:
        return f"unreadable (the weights-only unpickler: {unpickler.group(1).strip()})"
    return f"unreadable ({type(error).__name__}: {text or 'no reason given'})"


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
        raise CheckpointError(f"checkpoint {path}: {load_failure(e)}") from None
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


def run_id_of(path: Path) -> str | None:
    """The run id a checkpoint records, read without its tensor data (mmap); None for a file that is not a
    readable distrib checkpoint with one (junk, truncated, or written before checkpoints carried run ids)."""
    try:
        state = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - any file we cannot read is simply not this run's
        return None
    return state.get("run_id") if isinstance(state, dict) and state.get("format") == FORMAT else None


def read_owner(directory: Path) -> str | None:
    """The run that owns checkpoint.dir (the last one to write a checkpoint there); None in a fresh or older folder."""
    try:
        return (Path(directory) / OWNER_NAME).read_text().strip() or None
    except OSError:
        return None


def _newest_good(directory: Path, device: torch.device, say: Callable[[str], None],
                 owner: str | None = None) -> tuple[Path | None, dict | None]:
    for path in list_checkpoints(directory):
        if owner is not None and run_id_of(path) != owner:
            continue  # another run's checkpoint, kept beside this one (checkpoint.foreign=keep): never continued
        try:
            return path, read_checkpoint(path, device)
        except CheckpointError as e:
            say(f"{e}; falling back to the previous checkpoint")
    return None, None


def _choose(resume: str, directory: Path, device: torch.device, say) -> tuple[Path | None, dict | None]:
    if resume == "never":
        return None, None
    if resume == "auto":
        return _newest_good(directory, device, say, read_owner(directory))
    return Path(resume), read_checkpoint(Path(resume), device)


def _refuse_others(resume: str, directory: Path, others: list[Path]) -> None:
    """A new run in a folder that holds checkpoints it did not write: the user says which run the folder is for."""
    why = "resume=never" if resume == "never" else "none of them could be resumed"
    raise CheckpointError(
        f"checkpoint.dir = '{directory}': holds {len(others)} checkpoint file(s) of another run (newest "
        f"{others[0].name}) and this run starts afresh ({why}); continue that run with --set checkpoint.resume=auto "
        "(or a path), move them away, give this run a new --set run.dir, or train beside them (never deleted) with "
        "--set checkpoint.foreign=keep")


def _decide(resume: str, foreign: str, directory: Path, device: torch.device,
            say) -> tuple[Path | None, dict | None, str, list[Path]]:
    """Rank 0: the checkpoint to resume (if any), the run id this run writes, and its checkpoints in the folder."""
    path, state = _choose(resume, directory, device, say)
    if state is not None and state.get("run_id"):
        run_id = state["run_id"]
        return path, state, run_id, [p for p in reversed(list_checkpoints(directory)) if run_id_of(p) == run_id]
    others = list_checkpoints(directory)
    if state is None and others and foreign == "refuse":
        _refuse_others(resume, directory, others)
    return path, state, uuid.uuid4().hex[:12], []


def load_for_resume(resume: str, directory: Path, runtime: Runtime, say: Callable[[str], None],
                    foreign: str = "refuse") -> tuple[Path | None, dict | None, str, list[Path]]:
    """Rank 0 picks the checkpoint and the run id and broadcasts them; each rank loads the checkpoint; all check
    they hold the same bytes (one checksum: a checkpoint.dir that is not shared shows here). Returns the path and
    state (None: a new run), the run id, and (rank 0) this run's checkpoints already in the folder, oldest first."""
    path, state, run_id, owned, error = None, None, "", [], None
    if runtime.is_main:
        try:
            path, state, run_id, owned = _decide(resume, foreign, directory, runtime.device, say)
        except CheckpointError as e:
            error = str(e)
    choice = [str(path) if path else None, run_id, error]
    dist.broadcast_object_list(choice, src=0)  # every rank takes part: this is also where the others wait
    if choice[2]:
        raise CheckpointError(choice[2])
    if choice[0] and state is None:
        try:
            state = read_checkpoint(Path(choice[0]), runtime.device)
        except CheckpointError as e:
            error = str(e)  # said after the gather, on every rank, so that no rank waits for this one
    sums = [None] * runtime.world_size
    dist.all_gather_object(sums, error or (state["checksum"] if state else None))
    if len(set(sums)) != 1:
        ranks = ", ".join(f"rank {r}: {s if s and ' ' in s else (s or 'none')[:16]}" for r, s in enumerate(sums))
        raise CheckpointError(f"checkpoint {choice[0]}: the ranks did not load the same file ({ranks}); "
                              "checkpoint.dir must be one folder shared by every node")
    return (Path(choice[0]) if choice[0] else None), state, choice[1], owned


# ---------------------------------------------------------------- random number generators


def rng_state(runtime: Runtime) -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "device": runtime.device_rng_state()}


def set_rng_state(state: dict, runtime: Runtime) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    runtime.set_device_rng_state(state["device"])


@dataclass
class Checkpointer:
    """Saves the state that `collect` returns, plus every rank's RNG states and the run id, every `every_steps` steps;
    prunes only the checkpoints of this run (`owned`, oldest first), never a file another run wrote."""

    directory: Path
    every_steps: int
    keep_last: int
    runtime: Runtime
    collect: Callable[[], dict]
    foreign: str = "refuse"  # checkpoint.foreign: a new run beside another run's checkpoints is refused, or not
    run_id: str = ""  # set by load(): the resumed checkpoint's, or a new one
    resumed_from: Path | None = None  # set by load(): the checkpoint this run continues
    owned: list[Path] = field(default_factory=list)  # rank 0: this run's checkpoints in `directory`, oldest first

    def load(self, resume: str, say: Callable[[str], None]) -> dict | None:
        """Every rank: the state to resume from (None: a new run); fixes the run id and what this run may prune."""
        self.resumed_from, state, self.run_id, self.owned = load_for_resume(resume, self.directory, self.runtime, say,
                                                                            self.foreign)
        return state

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, step: int, path: Path | None = None) -> Path:
        """Called by every rank: gathers the RNG states, rank 0 writes, then tells every rank whether it worked.
        `path` (a best_*.pt of distrib.best) names another file of the same format, which keep_last never prunes."""
        states = [None] * self.runtime.world_size
        dist.all_gather_object(states, rng_state(self.runtime))
        periodic = path is None
        path = checkpoint_path(self.directory, step) if periodic else Path(path)
        error = None
        if self.runtime.is_main:
            try:
                self._write(path, {"format": FORMAT, "version": VERSION, "run_id": self.run_id, **self.collect(),
                                   "rng": states}, periodic)
            except UserError as e:
                error = e
        outcome = [error]
        dist.broadcast_object_list(outcome, src=0)  # the barrier: nobody moves on before the checkpoint is on disk
        if outcome[0] is not None:
            raise outcome[0]
        return path

    def _write(self, path: Path, state: dict, periodic: bool) -> None:
        state["checksum"] = digest(state)
        if read_owner(self.directory) != self.run_id:  # first, so resume=auto never again picks another run's
            save_atomic_text(self.run_id + "\n", self.directory / OWNER_NAME)
        try:
            save_atomic(state, path, tag=self.run_id)
        except EnvironmentFault as e:
            kept = f"; the newest checkpoint, {self.owned[-1]}, is intact" if self.owned else ""
            raise EnvironmentFault(f"checkpoint.dir: {e}{kept}") from None
        if not periodic:
            return
        self.owned = [p for p in self.owned if p != path] + [path]
        for old in self.owned[:-self.keep_last]:  # only now: the new checkpoint is safely in place
            old.unlink(missing_ok=True)
        self.owned = self.owned[-self.keep_last:]
        for stale in self.directory.glob(f".step_*.pt.{self.run_id}.*.tmp"):  # this run's, from a killed attempt
            stale.unlink(missing_ok=True)


def save_atomic_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a run without distrib's CLI (the bench) has none yet
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise EnvironmentFault(f"{path}: cannot be written ({e.strerror}); fix the folder or move it") from None
    finally:
        tmp.unlink(missing_ok=True)


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
