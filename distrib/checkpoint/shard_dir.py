"""A sharded checkpoint's directory (fsdp; any DTensor layout): its files, the commit that rank 0 makes once every
rank wrote its shards (fsync each file, the manifest last, an atomic rename into place), the check of the manifest
against the files, and the read of the shards back into this run's own layout (resharded, or gathered whole).

    checkpoints/step_00000020/    a complete checkpoint (temporary ones are .step_00000020.tmp/, never picked);
                                  step_00000020-RUNID/ beside another run's (distrib.checkpoint.format.NAME)
        __0_0.distcp ...          model, optimizer and EMA shards, one file per rank that wrote (DCP)
        .metadata                 DCP's index: every tensor's global shape and where each piece of it lives
        trainer.pt                progress, scheduler, scaler, every rank's RNGs and data position, config, run id
        manifest.json             written last: each file's size and sha256; a missing or changed file refuses it

Who writes it, and when (synchronously, in a thread or in the checkpoint process), is distrib.checkpoint.sharded."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from distrib.checkpoint.format import FORMAT, NAME, VERSION, CheckpointError, _fsync_dir, read_checkpoint

MANIFEST, TRAINER = "manifest.json", "trainer.pt"
WRITER = ".writer.lock"  # in a temporary directory: rank 0 holds its lock until the directory is committed
SHARDED = ("model", "optimizer", "ema")  # the parts DCP writes (ema: when on); the rest goes into trainer.pt


def list_sharded(directory: Path) -> list[Path]:
    """Committed step checkpoint directories, any run's (temporary ones never match the name), newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(2)), p) for p in directory.iterdir()
             if (m := NAME.match(p.name)) and m.group(1) == "step" and not m.group(4) and p.is_dir()]
    return [p for _, p in sorted(found, key=lambda item: (item[0], item[1].name), reverse=True)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _swap(tmp: Path, final: Path) -> None:
    """Renames tmp to final. A final that exists (a re-save of one step) is exchanged with tmp in one atomic
    renameat2 where the kernel can, so the folder never lacks that checkpoint (keep_last = 1), then removed."""
    if final.exists():
        libc = ctypes.CDLL(None, use_errno=True)
        exchange = getattr(libc, "renameat2", None)
        at_cwd, rename_exchange = -100, 2
        if exchange and exchange(at_cwd, os.fsencode(tmp), at_cwd, os.fsencode(final), rename_exchange) == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
            return
        shutil.rmtree(final, ignore_errors=True)  # no atomic exchange here: a moment without this step
    os.replace(tmp, final)


def commit_dir(tmp: Path, final: Path, lock: int) -> None:
    """Rank 0, once every rank's shards and DCP's .metadata are written: fsync each file, write the manifest last,
    rename the directory into place, fsync the parent."""
    files = {}
    for path in sorted(p for p in tmp.iterdir() if p.is_file() and p.name != WRITER):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = tmp / MANIFEST
    with open(manifest, "w") as f:
        json.dump({"format": FORMAT + ".sharded", "version": VERSION, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    (tmp / WRITER).unlink(missing_ok=True)
    os.close(lock)
    _fsync_dir(tmp)
    _swap(tmp, final)
    _fsync_dir(final.parent)


def abandon_dir(tmp: Path, lock: int) -> None:
    """Rank 0: a write that failed (its checkpoint process died) is removed, and its writer's lock let go."""
    os.close(lock)
    shutil.rmtree(tmp, ignore_errors=True)


def verify(path: Path, device: torch.device) -> dict:
    """Checks the manifest against the files (so a directory missing a rank's shards is refused); returns the
    verified trainer state (read_checkpoint checks its format and checksum)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST}, so it was never completed") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({e})") from None
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing (a rank's shards or DCP's index)")
        if file.stat().st_size != entry["bytes"] or _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum, the file is corrupt")
    if ".metadata" not in files or TRAINER not in files:
        raise CheckpointError(f"checkpoint {path}: the manifest lists no .metadata or {TRAINER}")
    return read_checkpoint(path / TRAINER, device)


def load_shards(path: Path, template: dict) -> dict:
    """Every rank: the DCP parts of checkpoint `path`, read into `template` (this run's own view of model,
    optimizer and EMA, keyed by name: its shards under fsdp, whole tensors under ddp), in place."""
    shards = {key: value for key, value in template.items() if key in SHARDED}
    dcp.load(shards, checkpoint_id=path)
    return shards
