"""The one-file checkpoint format (ddp): the complete training state written atomically by rank 0, verified by its
checksum, loaded safely (weights only); the atomic writes and the RNG states both formats use.

Which checkpoint a run resumes, prunes or keeps is not decided here but in distrib.checkpoint.policy."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from distrib.distributed.runtime import Runtime
from distrib.errors import EnvironmentFault, UserError

FORMAT, VERSION = "distrib.checkpoint", 1
# A checkpoint's name, in both formats: step_00000004 (best_00000004 for keep_best), then -RUNID when the run writes
# beside another run's checkpoints (checkpoint.foreign = keep), so that no run's save ever takes another's name; .pt
# for a file (ddp), nothing for a directory (fsdp). Groups: kind, step, run id or None, ".pt" or None.
NAME = re.compile(r"^(step|best)_(\d{8})(?:-([0-9a-f]+))?(\.pt)?$")


def checkpoint_name(kind: str, step: int, run_id: str = "") -> str:
    """The name of a checkpoint of `kind` (step | best) at `step`, without the format's suffix; run_id: when the run
    writes beside another run's checkpoints."""
    return f"{kind}_{step:08d}" + (f"-{run_id}" if run_id else "")


class CheckpointError(UserError):
    """A checkpoint that cannot be used: the message names the file and the reason."""


# ---------------------------------------------------------------- atomic files


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hold(path: Path) -> int:
    """An exclusive lock on `path` (created), held until the fd is closed or the process dies: what tells a live
    writer's temporary file from a dead one's (distrib.checkpoint.folder.remove_dead_temps)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def is_held(path: Path) -> bool:
    """Whether a live process holds `path`'s lock (hold); False for a file nobody holds or that is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return True  # cannot tell (a filesystem without locks): leave it be
    finally:
        os.close(fd)


def save_atomic(obj, path: Path, tag: str = "") -> Path:
    """torch.save to a temp file in the same directory (locked while written), fsync, rename into place, fsync the
    directory: a crash at any moment leaves either the old file or the new one under `path`, never a partial one. A
    full disk or an unwritable folder is an EnvironmentFault that says how much space the file needs; the old file
    stays."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{tag + '.' if tag else ''}{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file is closed or this process dies
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
    text = " ".join(str(error).split()).split(" This is an internal miniz error.")[0]  # then torch's advice, 300 chars
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


# ---------------------------------------------------------------- the one-file format


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete one-file step checkpoints, any run's (temp files never match the name), newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(2)), p) for p in directory.iterdir()
             if (m := NAME.match(p.name)) and m.group(1) == "step" and m.group(4)]
    return [p for _, p in sorted(found, key=lambda item: (item[0], item[1].name), reverse=True)]


def run_id_of(path: Path) -> str | None:
    """The run id a checkpoint records, read without its tensor data (mmap); None for a file that is not a
    readable distrib checkpoint with one (junk, truncated, or written before checkpoints carried run ids)."""
    try:
        state = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception:  # noqa: BLE001 - any file we cannot read is simply not this run's
        return None
    return state.get("run_id") if isinstance(state, dict) and state.get("format") == FORMAT else None


class FileStorage:
    """One file per checkpoint, written by rank 0: under ddp every rank holds the whole state."""

    kind = "one-file (ddp)"

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def target(self, directory: Path, name: str) -> Path:
        return Path(directory) / f"{name}.pt"

    def write(self, path: Path, state: dict, committed: Callable[[], None] | None) -> None:
        """Every rank calls it; rank 0 writes and then runs `committed`; every rank learns whether it worked."""
        error = None
        if self.runtime.is_main:
            try:
                state["checksum"] = digest(state)
                save_atomic(state, path, tag=state.get("run_id", ""))
                if committed is not None:
                    committed()
            except UserError as e:
                error = e
        outcome = [error]
        dist.broadcast_object_list(outcome, src=0)  # the barrier: nobody moves on before the checkpoint is on disk
        if outcome[0] is not None:
            raise outcome[0]

    def start(self) -> None:
        """Nothing runs in the background."""

    def wait(self) -> None:
        """Nothing in flight: every write returns once the file is in place."""

    def close(self) -> None:
        """Nothing held."""


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
