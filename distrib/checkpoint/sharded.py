"""The sharded checkpoint format's writer (fsdp; any DTensor layout): each rank writes its shards with
torch.distributed.checkpoint into a temporary directory, synchronously, in a thread, or in its checkpoint process, and
rank 0 commits it (distrib.checkpoint.shard_dir: the directory's files, its commit, its check and its load).

Which checkpoint a run resumes, prunes or keeps is not decided here but in distrib.checkpoint.policy."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from distrib.checkpoint.format import CheckpointError, digest, hold, save_atomic
from distrib.checkpoint.process import CheckpointProcess, agree_on_writers, shared_stager
from distrib.checkpoint.shard_dir import SHARDED, TRAINER, WRITER, abandon_dir, commit_dir
from distrib.distributed.runtime import Runtime
from distrib.errors import EnvironmentFault, UserError, say


class _Write:
    """An asynchronous DCP write in flight and, on rank 0, its commit once the write is done (a thread of its own,
    so that neither the write nor the checksums hold up training)."""

    def __init__(self, future, commit: Callable[[], None] | None, name: str = "",
                 abandon: Callable[[], None] | None = None):
        self.error: BaseException | None = None
        self.name, self.abandon = name, abandon  # the checkpoint's name; rank 0: removes a write that failed
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


# How many times the checkpoint processes are replaced after one died, before the run saves blocking for good.
REPLACEMENTS = 3


class ShardedStorage:
    """The model, optimizer and EMA shards through DCP, the rest of the state (and every rank's RNGs) into
    trainer.pt. async_save (checkpoint.async_save): "off"; "thread", one write at a time in a thread of this
    process; "process", one at a time in this rank's checkpoint process, from a copy in shared memory."""

    kind = "sharded (fsdp)"

    def __init__(self, runtime: Runtime, async_save: str = "off"):
        self.runtime, self.async_save = runtime, async_save
        # The background write's collectives get a group of their own (every rank creates it, here, in order).
        self.group = runtime.new_cpu_group() if async_save != "off" else None
        self.process: CheckpointProcess | None = None  # started by start(), or by the first write
        self.stager = None  # the process's copies in shared memory, reused by every save
        self.pending: _Write | None = None
        self.died: str | None = None  # every rank: what died since the last save, agreed on (_settle)
        self.replaced = 0  # how many times the checkpoint processes were replaced

    def start(self) -> None:
        """Every rank (a broadcast): the checkpoint process of checkpoint.async_save = process starts."""
        if self.async_save == "process" and self.process is None:
            self.process, self.stager = CheckpointProcess(self.group), shared_stager(self.runtime.pin_memory)

    def target(self, directory: Path, name: str) -> Path:
        return Path(directory) / name

    def write(self, path: Path, state: dict, committed: Callable[[], None] | None) -> None:
        """Every rank calls it. Synchronous: returns once the checkpoint is committed (and `committed` ran on rank
        0). Asynchronous: once this rank's shards are staged in host memory; the commit follows in the background."""
        self.wait()  # the previous write is committed before the next one begins
        shards = {key: state.pop(key) for key in SHARDED if key in state}
        tmp = path.with_name(f".{path.name}.tmp")
        lock, error = None, None
        if self.runtime.is_main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)  # this run's own, from a write that failed
                tmp.mkdir(parents=True)
                lock = hold(tmp / WRITER)
                state["checksum"] = digest(state)
                save_atomic(state, tmp / TRAINER)
            except UserError as e:
                error = e
        outcome = [error]
        dist.broadcast_object_list(outcome, src=0)  # the temporary directory is ready before any rank writes into it
        if outcome[0] is not None:
            raise outcome[0]

        def commit() -> None:
            commit_dir(tmp, path, lock)
            if committed is not None:
                committed()

        if self.async_save == "process" and not self.died:
            self._settle(None, final=False)  # one that died between saves
        if self.async_save != "off" and not self.died:
            main = self.runtime.is_main
            self.pending = _Write(self._start_write(shards, tmp), commit if main else None, path.name,
                                  (lambda: abandon_dir(tmp, lock)) if main else None)
            return
        dcp.save(shards, checkpoint_id=tmp)  # returns once every rank's shards and the .metadata are written
        if self.runtime.is_main:
            commit()
        dist.barrier()  # nobody moves on (or exits) before the checkpoint is in place
        if self.died:
            self._replace(path.name)

    def _start_write(self, shards: dict, tmp: Path):
        """The write's future, once this rank's shards are copied: to host memory (thread), or to shared memory
        that the checkpoint process writes from (process)."""
        if self.async_save == "thread":
            return dcp.async_save(shards, checkpoint_id=tmp, process_group=self.group)
        self.start()
        self.process.ready()  # the first save waits here if the process is still starting
        return dcp.async_save(shards, checkpoint_id=tmp, process_group=self.group, async_stager=self.stager,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)

    def wait(self, final: bool = False) -> None:
        """Blocks until the asynchronous write in flight (if any) is written and, on rank 0, committed. final: no
        checkpoint follows (the end of the run, a preemption)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if self.async_save != "process":
            pending.wait()
            return
        pending.thread.join()
        self._settle(pending, final)

    def _settle(self, pending: _Write | None, final: bool) -> None:
        """Every rank, in process mode, after a write (pending) or before one: whether any rank's
        checkpoint process died. One that did is no user's mistake: the next checkpoint is written by the training
        processes and new checkpoint processes start (_replace); the write it took with it is lost, which only the
        last one of a run cannot make good: an EnvironmentFault (exit 74) that says what died."""
        deaths, errors = agree_on_writers(self.process, pending.error if pending else None)
        if not deaths:
            if errors:
                raise CheckpointError(f"asynchronous checkpoint write failed: {errors[0]}")
            return
        if errors and pending.abandon is not None and pending.error is not None:  # rank 0, which never committed it
            pending.abandon()
        self.died = ", ".join(deaths) + (f" died, and the write of {pending.name} with it" if errors else " died")
        if final and errors:
            raise EnvironmentFault(f"checkpoint.async_save = process: {self.died}; the run's last checkpoint is lost, "
                                   "the one before is intact: run the same command again to resume there")

    def _replace(self, name: str) -> None:
        """Every rank, once the checkpoint `name` is written without them: the checkpoint processes are replaced
        (the new ones start as training goes on), or, after REPLACEMENTS, the run saves blocking from here on."""
        self._end_process()
        self.replaced += 1
        again = self.replaced < REPLACEMENTS
        if self.runtime.is_main:
            say(f"distrib: warning: {self.died}; checkpoint {name} was written by the training processes, "
                + ("the next ones by new checkpoint processes" if again else
                   f"and so are the next ones (the checkpoint processes died {self.replaced} times)"))
        self.died = None
        if again:
            self.start()
        else:
            self.async_save = "off"

    def _end_process(self) -> None:
        if self.process is not None:
            self.process.close()
            self.stager.close()
            self.process = None

    def close(self) -> None:
        """Waits for the write in flight, then ends the checkpoint process and frees the shared copies."""
        try:
            self.wait(final=True)
        finally:
            self._end_process()
