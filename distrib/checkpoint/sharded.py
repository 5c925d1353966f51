"""Sharded checkpoints (dist.strategy = fsdp): each rank writes its shards with torch.distributed.checkpoint into a
temporary directory that rank 0 verifies, fsyncs and renames into place; loading reshards to any world size.

    checkpoints/step_00000020/    a complete checkpoint (temporary ones are .step_00000020.tmp/, never picked)
        __0_0.distcp ...          model and optimizer shards, one file per rank that wrote (DCP)
        .metadata                 DCP's index: every tensor's global shape and where each piece of it lives
        trainer.pt                progress, scheduler, scaler, every rank's RNGs, config (rank 0, with a checksum)
        manifest.json             written last: each file's size and sha256; a missing or changed file refuses it
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from distrib.checkpoint.format import (
    FORMAT,
    VERSION,
    Checkpointer,
    CheckpointError,
    _fsync_dir,
    digest,
    read_checkpoint,
    rng_state,
    save_atomic,
)
from distrib.config import CheckpointConfig
from distrib.distributed.runtime import Runtime
from distrib.launch.preempt import Preempted

_NAME = re.compile(r"^step_(\d{8})$")
MANIFEST, TRAINER = "manifest.json", "trainer.pt"
SHARDED = ("model", "optimizer", "ema")  # the parts DCP writes (ema: when on); the rest goes into trainer.pt


def step_dir(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def list_sharded(directory: Path) -> list[Path]:
    """Committed checkpoint directories (temporary ones never match the name), newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir()), reverse=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _commit(tmp: Path, final: Path, keep_last: int) -> None:
    """Rank 0, once every rank's shards and DCP's .metadata are written: fsync each file, write the manifest last,
    rename the directory into place, fsync the parent; only then prune."""
    files = {}
    for path in sorted(p for p in tmp.iterdir() if p.is_file()):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = tmp / MANIFEST
    with open(manifest, "w") as f:
        json.dump({"format": FORMAT + ".sharded", "version": VERSION, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (a resumed run's final save)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    for old in list_sharded(final.parent)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in final.parent.glob(".step_*.tmp"):  # from killed runs: rank 0 waits for its own before a new one
        shutil.rmtree(stale, ignore_errors=True)


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


def _choose(resume: str, directory: Path, device: torch.device, say) -> tuple[Path | None, dict | None]:
    if resume == "never":
        return None, None
    if resume != "auto":
        if Path(resume).is_file():
            raise CheckpointError(f"checkpoint {resume}: a one-file (ddp) checkpoint, and dist.strategy = 'fsdp' "
                                  "resumes from sharded directories; resume it with --set dist.strategy=ddp")
        return Path(resume), verify(Path(resume), device)
    for path in list_sharded(directory):
        try:
            return path, verify(path, device)
        except CheckpointError as e:
            say(f"{e}; falling back to the previous checkpoint")
    if any(Path(directory).glob("step_*.pt")):  # never start over silently beside another strategy's progress
        raise CheckpointError(f"checkpoint.dir {directory}: holds one-file (ddp) checkpoints and no sharded ones; "
                              "resume with --set dist.strategy=ddp, or start afresh with a new checkpoint.dir")
    return None, None


class _Write:
    """An asynchronous DCP write in flight and, on rank 0, its commit once the write is done (a thread of its own,
    so that neither the write nor the checksums hold up training)."""

    def __init__(self, future, commit: Callable[[], None] | None):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(future, commit), daemon=True, name="distrib-ckpt")
        self.thread.start()

    def _run(self, future, commit) -> None:
        try:
            future.result()
            if commit is not None:
                commit()
        except BaseException as e:  # noqa: BLE001 - reported by wait(), on the training thread
            self.error = e

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise CheckpointError(f"asynchronous checkpoint write failed: {self.error}") from self.error


class ShardedCheckpointer:
    """Every `every_steps` steps: the model and optimizer shards of `collect()` through DCP, the rest of it (and
    every rank's RNGs) into trainer.pt. With async_save, one write at a time runs in the background."""

    def __init__(self, directory: Path, every_steps: int, keep_last: int, runtime: Runtime,
                 collect: Callable[[], dict], async_save: bool = False):
        self.directory, self.every_steps, self.keep_last = Path(directory), every_steps, keep_last
        self.runtime, self.collect, self.async_save = runtime, collect, async_save
        # The background write's collectives get a group of their own (every rank creates it, here, in order).
        self.group = runtime.new_cpu_group() if async_save else None
        self.pending: _Write | None = None
        self.resumed_from: Path | None = None  # set by load(): the checkpoint this run continues

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def save(self, step: int) -> Path:
        """Called by every rank. Synchronous: returns once the checkpoint is committed. Asynchronous: once this
        rank's shards are staged in host memory; the commit follows when every rank's write is done."""
        self.wait()  # the previous write is committed before the next one begins
        rngs = [None] * self.runtime.world_size
        dist.all_gather_object(rngs, rng_state(self.runtime))
        state = self.collect()
        shards = {key: state.pop(key) for key in SHARDED if key in state}
        final = step_dir(self.directory, step)
        tmp = final.with_name(f".{final.name}.tmp")
        if self.runtime.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
            tmp.mkdir(parents=True)
            trainer = {"format": FORMAT, "version": VERSION, **state, "rng": rngs}
            trainer["checksum"] = digest(trainer)
            save_atomic(trainer, tmp / TRAINER)
        dist.barrier()  # the temporary directory is fresh before any rank writes into it
        commit = (lambda: _commit(tmp, final, self.keep_last)) if self.runtime.is_main else None
        if self.async_save:
            self.pending = _Write(dcp.async_save(shards, checkpoint_id=tmp, process_group=self.group), commit)
            return final
        dcp.save(shards, checkpoint_id=tmp)  # returns once every rank's shards and the .metadata are written
        if commit is not None:
            commit()
        dist.barrier()  # nobody moves on (or exits) before the checkpoint is in place
        return final

    def wait(self) -> None:
        """Blocks until the asynchronous write in flight (if any) is written and, on rank 0, committed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def load(self, resume: str, say: Callable[[str], None]) -> dict | None:
        """Rank 0 picks and verifies the checkpoint and broadcasts its choice; every rank loads its part of the
        shards, resharded by DCP to this run's world size; all check they hold one step."""
        path, state, error = None, None, None
        if self.runtime.is_main:
            try:
                path, state = _choose(resume, self.directory, self.runtime.device, say)
            except CheckpointError as e:
                error = str(e)
        choice = [str(path) if path else None, error]
        dist.broadcast_object_list(choice, src=0)
        if choice[1]:
            raise CheckpointError(choice[1])
        self.resumed_from = Path(choice[0]) if choice[0] else None
        if choice[0]:
            if state is None:
                state = read_checkpoint(Path(choice[0]) / TRAINER, self.runtime.device)
            shards = {key: value for key, value in self.collect().items() if key in SHARDED}  # filled in place
            dcp.load(shards, checkpoint_id=choice[0])
            state.update(shards)
        steps = [None] * self.runtime.world_size
        dist.all_gather_object(steps, state["progress"]["step"] if state else -1)
        if len(set(steps)) != 1:
            raise CheckpointError(f"checkpoint {choice[0]}: ranks loaded different steps {steps}; "
                                  "checkpoint.dir must be one directory shared by every node")
        return state


@contextlib.contextmanager
def committing(checkpointer) -> Iterator[None]:
    """Around training: an asynchronous write still in flight at the end or at a preemption is waited for and
    committed before the run goes on (or exits 75); after an error it stays a temporary directory, never picked."""
    wait = getattr(checkpointer, "wait", None)
    try:
        yield
    except Preempted:
        if wait:
            wait()
        raise
    if wait:
        wait()


def make_checkpointer(config: CheckpointConfig, strategy: str, directory: Path, runtime: Runtime,
                      collect: Callable[[], dict]) -> Checkpointer | ShardedCheckpointer:
    """One file by rank 0 under ddp (the whole state is on every rank); sharded directories under fsdp and hsdp."""
    if strategy in ("fsdp", "hsdp"):
        return ShardedCheckpointer(directory, config.every_steps, config.keep_last, runtime, collect,
                                   config.async_save)
    return Checkpointer(directory, config.every_steps, config.keep_last, runtime, collect, foreign=config.foreign)
