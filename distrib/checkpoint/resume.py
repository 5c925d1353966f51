"""Which checkpoint a run resumes, for either format: the newest good one of the run that owns checkpoint.dir (a ddp
checkpoint resumes under fsdp and back), the run id it writes, the checkpoints it owns (the only ones it prunes), the
refusal of another run's folder (checkpoint.foreign) or of one whose checkpoints are all damaged, and the check of the
config and of the data (distrib.data.identity) against the checkpoint's. Rank 0 decides (distrib.checkpoint.policy
tells every rank)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Callable

import torch

from distrib.checkpoint.folder import damaged, listing, read_owner, read_stored, step_of, stored_run_id
from distrib.checkpoint.format import NAME, CheckpointError
from distrib.data.identity import data_changes

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
