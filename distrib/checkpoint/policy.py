"""The checkpoint policy, written once for every format: the Checkpointer that resumes the checkpoint rank 0 chose
(distrib.checkpoint.resume: the newest good one, the run id, the compatibility check) on every rank, saves every
every_steps, prunes only this run's checkpoints (keep_last; keep_best in distrib.checkpoint.best), never overwrites
another run's, and removes the temporary files of dead writers. Rank 0 decides; every rank hears the same decision."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import torch.distributed as dist

from distrib.checkpoint.contract import Storage
from distrib.checkpoint.folder import remove, remove_dead_temps, stored_run_id, write_owner
from distrib.checkpoint.format import FORMAT, VERSION, CheckpointError, FileStorage, checkpoint_name, read_checkpoint
from distrib.checkpoint.resume import check_compatible, check_data, decide
from distrib.checkpoint.shard_dir import TRAINER, load_shards
from distrib.checkpoint.sharded import ShardedStorage
from distrib.config import CheckpointConfig
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import Strategy
from distrib.errors import EnvironmentFault, UserError
from distrib.launch.preempt import Preempted


class Checkpoints:
    """The Checkpointer of every strategy: the policy (here and in distrib.checkpoint.resume), over a storage
    format. Saves the state `collect` returns, plus every rank's RNG states, the run id and what identifies the data,
    every `every_steps` steps; keeps this run's last `keep_last` (a save is in place before anything is pruned, so 1
    is safe) and never touches another run's. `identify` (rank 0, once, in load): the data's identity
    (distrib.data.identity)."""

    def __init__(self, storage: Storage, directory: Path, runtime: Runtime, collect: Callable[..., dict], *,
                 every_steps: int, keep_last: int, foreign: str = "refuse", config: dict | None = None,
                 allow_config_change: bool = False, identify: Callable[[], dict] | None = None):
        self.storage, self.directory, self.runtime, self.collect = storage, Path(directory), runtime, collect
        self.every_steps, self.keep_last, self.foreign = every_steps, keep_last, foreign
        self.config, self.allow_config_change = config, allow_config_change  # config: checked against a resume's
        self.identify, self.data_identity = identify, None  # data_identity: rank 0's, set by load, saved with each
        self.run_id, self.resumed_from = "", None
        self.tagged = False  # whether this run's checkpoint names carry its run id (set by load)
        self.owned: list[Path] = []  # rank 0: this run's periodic checkpoints in `directory`, oldest first

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def name(self, step: int, *, best: bool = False) -> str:
        return checkpoint_name("best" if best else "step", step, self.run_id if self.tagged else "")

    def load(self, resume: str, say: Callable[[str], None]) -> dict | None:
        """Rank 0 picks the checkpoint and the run id and broadcasts them; each rank loads the checkpoint; all check
        they hold the same bytes (one checksum: a checkpoint.dir that is not shared shows here)."""
        path, state, error = None, None, None
        if self.runtime.is_main:
            try:
                self.data_identity = self.identify() if self.identify is not None else None
                path, state, self.run_id, self.owned, self.tagged = decide(resume, self.foreign, self.directory,
                                                                           self.runtime.device, say)
                if state is not None:  # here, so that the verdict reaches every rank with the choice
                    check_data(str(path), state, self.data_identity, self.allow_config_change, say)
                for name in remove_dead_temps(self.directory):  # only once the folder is known to be this run's
                    say(f"checkpoint.dir: removed {name}, left by a writer that died")
                if self.tagged:
                    say(f"checkpoint.dir = '{self.directory}' holds another run's checkpoints: this run's are named "
                        f"step_N-{self.run_id} (best_N-{self.run_id}), so that no run's ever takes another's name")
            except CheckpointError as e:
                error = str(e)
            except OSError as e:  # a data file gone since it was read: the same line on every rank
                error = f"data: {e}"
        choice = [str(path) if path else None, self.run_id, error, self.tagged]
        dist.broadcast_object_list(choice, src=0)  # every rank takes part: this is also where the others wait
        if choice[2]:
            raise CheckpointError(choice[2])
        self.run_id, self.resumed_from, self.tagged = choice[1], (Path(choice[0]) if choice[0] else None), choice[3]
        if self.resumed_from and state is None:
            try:
                state = read_checkpoint(self.resumed_from / TRAINER if self.resumed_from.is_dir()
                                        else self.resumed_from, self.runtime.device)
            except CheckpointError as e:
                error = str(e)  # said after the gather, on every rank, so that no rank waits for this one
        self._agree(choice[0], error or (state["checksum"] if state else None))
        if state is None:
            return None
        self._check(state, say)
        if self.resumed_from.is_dir():  # every rank: its part of the shards, resharded (or gathered) by DCP
            state.update(load_shards(self.resumed_from, self.collect(named=True)))
        return state

    def _agree(self, path: str | None, mine: str | None) -> None:
        sums = [None] * self.runtime.world_size
        dist.all_gather_object(sums, mine)
        if len(set(sums)) != 1:
            ranks = ", ".join(f"rank {r}: {s if s and ' ' in s else (s or 'none')[:16]}" for r, s in enumerate(sums))
            raise CheckpointError(f"checkpoint {path}: the ranks did not load the same file ({ranks}); "
                                  "checkpoint.dir must be one folder shared by every node")

    def _check(self, state: dict, say: Callable[[str], None]) -> None:
        """The compatibility check, and one line when the checkpoint is of the other format."""
        path = self.resumed_from
        if self.config is not None:
            changed = check_compatible(str(path), state["config"], self.config, self.allow_config_change)
            if changed:
                say(f"checkpoint {path}: resumed with the allowed changes {'; '.join(changed)}")
        theirs = ShardedStorage.kind if path.is_dir() else FileStorage.kind
        if theirs != self.storage.kind:
            say(f"checkpoint {path}: a {theirs} checkpoint resumed in the {self.storage.kind} format; both hold the "
                "full training state, so the resume is exact (only the layout of the tensors changes)")

    def save(self, step: int, *, best: bool = False) -> Path:
        """Every rank: gathers the RNG states, then the storage writes; rank 0 prunes once the new one is in place."""
        self.storage.wait()  # the previous write (and its pruning) is done before the next one begins
        rngs = [None] * self.runtime.world_size
        dist.all_gather_object(rngs, self.runtime.rng_state())
        path = self.storage.target(self.directory, self.name(step, best=best))
        verdict = [None, ""]
        if self.runtime.is_main:
            try:
                self._claim(path, step)
            except UserError as e:
                verdict[0] = e
            verdict[1] = str(self.owned[-1]) if self.owned else ""
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise verdict[0]
        state = {"format": FORMAT, "version": VERSION, "run_id": self.run_id, **self.collect(),
                 "data_identity": self.data_identity, "rng": rngs}
        try:
            self.storage.write(path, state, (lambda: self._committed(path, best)) if self.runtime.is_main else None)
        except EnvironmentFault as e:
            kept = f"; the newest checkpoint, {verdict[1]}, is intact" if verdict[1] else ""
            raise EnvironmentFault(f"checkpoint.dir: {e}{kept}") from None
        return path

    def _claim(self, path: Path, step: int) -> None:
        """Rank 0: never overwrite another run's checkpoint; the folder is this run's from its first save on."""
        other = stored_run_id(path) if path.exists() else None
        if other is not None and other != self.run_id:
            raise CheckpointError(
                f"checkpoint.dir = '{self.directory}': {path.name} is another run's checkpoint (run {other}, kept by "
                f"checkpoint.foreign=keep), which this run's save at step {step} would overwrite; give this run its "
                "own --set checkpoint.dir, or move that run's checkpoints away")
        write_owner(self.directory, self.run_id)  # first, so resume=auto never again picks another run's

    def _committed(self, path: Path, best: bool) -> None:
        """Rank 0, once `path` is in place: prune this run's periodic checkpoints to the last keep_last."""
        if best:
            return  # keep_best prunes its own (distrib.checkpoint.best)
        self.owned = [p for p in self.owned if p != path] + [path]
        for old in self.owned[:-self.keep_last]:
            remove(old)
        self.owned = self.owned[-self.keep_last:]

    def start(self) -> None:
        self.storage.start()

    def wait(self) -> None:
        self.storage.wait()

    def close(self) -> None:
        self.storage.close()


def make_checkpointer(config: CheckpointConfig, strategy: Strategy, directory: Path, runtime: Runtime,
                      collect: Callable[..., dict], run_config: dict | None = None,
                      identify: Callable[[], dict] | None = None) -> Checkpoints:
    """One file by rank 0 where the strategy's state is whole on every rank (ddp); sharded directories where each
    rank holds shards (fsdp, hsdp, tensor parallel). The policy is the same; run_config and identify (the data's
    identity) are what a resumed checkpoint is checked against."""
    storage = ShardedStorage(runtime, config.async_save) if strategy.sharded_state else FileStorage(runtime)
    return Checkpoints(storage, directory, runtime, collect, every_steps=config.every_steps,
                       keep_last=config.keep_last, foreign=config.foreign, config=run_config,
                       allow_config_change=config.allow_config_change, identify=identify)


@contextlib.contextmanager
def committing(checkpointer) -> Iterator[None]:
    """Around training: the background writer starts (checkpoint.async_save = process: its process, whose start
    overlaps the first steps); an asynchronous write still in flight at the end or at a preemption is waited for and
    committed before the run goes on (or exits 75); after an error it stays a temporary directory, never picked (and
    the checkpoint process ends with this one)."""
    checkpointer.start()
    try:
        yield
    except Preempted:
        checkpointer.close()
        raise
    checkpointer.close()
