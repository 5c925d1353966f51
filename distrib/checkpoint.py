"""Writing model and training state to disk so that a crash never leaves a half-written file under the final name.

Rank 0 writes; callers keep every rank's collectives symmetric around it."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(obj, path: Path) -> Path:
    """torch.save to a temp file in the same directory, fsync, rename into place, fsync the directory."""
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
