"""Which checkpoint, written once for every format: the newest good one of the run that owns checkpoint.dir (either
format: a ddp checkpoint resumes under fsdp and back), the run id, the refusal of another run's folder
(checkpoint.foreign), pruning only this run's checkpoints (keep_last), the best k (keep_best), the compatibility
check of the config and of the data (distrib.data.identity), and the temporary files of dead writers. Rank 0 decides;
every rank hears the same decision."""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from distrib.checkpoint.contract import Storage
from distrib.checkpoint.folder import (
    damaged,
    listing,
    read_owner,
    read_stored,
    remove,
    remove_dead_temps,
    step_of,
    stored_run_id,
    write_owner,
)
from distrib.checkpoint.format import (
    FORMAT,
    NAME,
    VERSION,
    CheckpointError,
    FileStorage,
    checkpoint_name,
    read_checkpoint,
)
from distrib.checkpoint.sharded import TRAINER, ShardedStorage, load_shards
from distrib.config import CheckpointConfig
from distrib.data.identity import data_changes
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import Strategy
from distrib.errors import EnvironmentFault, UserError
from distrib.launch.preempt import Preempted

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


def check_data(path: str, saved: dict, current: dict | None, allow_change: bool, say: Callable[[str], None]) -> None:
    """Rank 0: the data this run reads against the checkpoint's (state["data_identity"]): a change is one line and
    an error unless the user allowed it; a checkpoint that records nothing of its data is resumed, and said so."""
    if "data_identity" not in saved:
        say(f"checkpoint {path}: records nothing that identifies its data (it was written before distrib did), so "
            "this run cannot check that it reads the same data")
    if saved.get("data_identity") is None or current is None:  # also data built without one (Data(...) by hand)
        return
    changes = data_changes(saved["data_identity"], current)
    if not changes:
        return
    listed = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
    if not allow_change:
        raise CheckpointError(f"checkpoint {path}: the data changed since it was taken ({listed}), so a resume would "
                              "not continue the same run; restore the data, use a new checkpoint.dir, or "
                              "--set checkpoint.allow_config_change=true")
    say(f"checkpoint {path}: resumed on changed data, as checkpoint.allow_config_change allows: {listed}")


def _get(tree: dict, dotted: str):
    section, key = dotted.split(".")
    return tree.get(section, {}).get(key)


def _newest_good(directory: Path, device: torch.device, say: Callable[[str], None], owner: str | None = None,
                 broken: dict[Path, str] | None = None) -> tuple[Path | None, dict | None]:
    """The newest checkpoint of `owner` (any, for None) that passes its check; each one that fails goes into
    `broken` (path: why) and is said; those already in it are skipped."""
    broken = {} if broken is None else broken
    for path in listing(directory):
        if path in broken or owner is not None and stored_run_id(path) != owner:
            continue  # damaged, or another run's checkpoint kept beside this one (foreign=keep): never continued
        try:
            return path, read_stored(path, device)
        except CheckpointError as e:
            broken[path] = str(e)
            say(f"{e}; falling back to the previous checkpoint")
    return None, None


def choose(resume: str, directory: Path, device: torch.device, say,
           broken: dict[Path, str] | None = None) -> tuple[Path | None, dict | None]:
    """Rank 0: the checkpoint checkpoint.resume names, of either format, and its verified state; broken: the
    damaged ones (path: why), never chosen, and where those found damaged on the way go."""
    if resume == "never":
        return None, None
    if resume == "auto":
        return _newest_good(directory, device, say, read_owner(directory), broken)
    return Path(resume), read_stored(Path(resume), device)


def resumable(resume: str, directory: Path) -> bool:
    """Rank 0, before the model is built: whether choose() will find a checkpoint to resume, from names and run ids
    only (no state is read), so that model.init_from is not read for weights the checkpoint replaces. choose() may
    still find each of them damaged; the worker then reads model.init_from after all."""
    if resume == "never":
        return False
    if resume != "auto":
        return True  # a path: resumed, or refused in one line
    owner = read_owner(directory)
    return any(owner is None or stored_run_id(path) == owner for path in listing(directory))


def _refuse_others(resume: str, directory: Path, others: list[Path]) -> None:
    """A new run in a folder that holds checkpoints it did not write: the user says which run the folder is for."""
    why = "resume=never" if resume == "never" else "none of them could be resumed"
    raise CheckpointError(
        f"checkpoint.dir = '{directory}': holds {len(others)} checkpoint(s) of another run (newest "
        f"{others[0].name}) and this run starts afresh ({why}); continue that run with --set checkpoint.resume=auto "
        "(or a path), move them away, give this run a new --set run.dir, or train beside them (never deleted) with "
        "--set checkpoint.foreign=keep")


def _refuse_damaged(directory: Path, broken: dict[Path, str]) -> None:
    """resume=auto, and every checkpoint that could be this run's is damaged: one line, never a silent start afresh."""
    newest = broken[max(broken, key=step_of)]
    raise CheckpointError(
        f"checkpoint.dir = '{directory}': nothing to resume, its {len(broken)} checkpoint(s) that could continue the "
        f"run are damaged (the newest: {newest}); restore them from a copy and run the same command again, or start "
        "afresh with --set checkpoint.resume=never (the damaged files stay, unless a save takes one's name)")


def decide(resume: str, foreign: str, directory: Path, device: torch.device,
           say) -> tuple[Path | None, dict | None, str, list[Path], bool]:
    """Rank 0: the checkpoint to resume (if any), the run id this run writes, its checkpoints in the folder, oldest
    first (the only ones it will ever prune: a resumed run's damaged ones under its names first), and whether its
    names carry its run id: when the folder holds another run's checkpoints (checkpoint.foreign = keep), so that no
    save of this run ever takes one of their names. A damaged checkpoint is said once and skipped; cut short or
    garbled (its run id unreadable), it counts as no run's. With every one damaged, resume=auto is refused in one
    line (foreign=keep: the run starts afresh)."""
    broken = damaged(directory)
    path, state = choose(resume, directory, device, lambda line: None, broken)  # said below, once each
    if state is None and resume == "auto" and broken and foreign == "refuse":
        _refuse_damaged(directory, broken)
    run_id = state.get("run_id") if state is not None else None
    if not run_id:
        others = [p for p in listing(directory) if p not in broken]
        if state is None and others and foreign == "refuse":
            _refuse_others(resume, directory, others)
        run_id = uuid.uuid4().hex[:12]
    ids = {p: stored_run_id(p) for p in [*listing(directory), *listing(directory, "best")]}
    tagged = any(other != run_id for p, other in ids.items() if other or p not in broken)  # one unread is nobody's
    resumed = state is not None  # only a run that continues here takes a damaged one under its names for its own
    ours = [p for p in reversed(listing(directory)) if p in broken and resumed and (ids[p] == run_id if ids[p] else
                                                                                    _named_for(p, run_id, tagged))]
    for broken_path in sorted(broken, key=step_of, reverse=True):
        fate = "; deleted as this run prunes its older checkpoints" if broken_path in ours else ""
        say(f"{broken[broken_path]}: damaged, so skipped (never resumed){fate}")
    owned = [p for p in reversed(listing(directory)) if p not in broken and ids[p] == run_id]
    return path, state, run_id, [*ours, *owned], tagged


def _named_for(path: Path, run_id: str, tagged: bool) -> bool:
    """Whether `path`'s name is one this run's saves give: step_N-RUNID, or step_N where it writes short names."""
    named = NAME.match(path.name).group(3)
    return named == run_id or (named is None and not tagged)


class Checkpoints:
    """The Checkpointer of every strategy: the policy above, over a storage format. Saves the state `collect`
    returns, plus every rank's RNG states, the run id and what identifies the data, every `every_steps` steps;
    keeps this run's last `keep_last` (a save is in place before anything is pruned, so 1 is safe) and never touches
    another run's. `identify` (rank 0, once, in load): the data's identity (distrib.data.identity)."""

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
