"""Best-k checkpoints (checkpoint.keep_best): after each evaluation, a checkpoint of the k best evaluations by
checkpoint.best_metric is kept as best_STEP (best_STEP.pt under ddp, a best_STEP/ directory under fsdp; best_STEP-RUNID
beside another run's checkpoints), in the verified format of the periodic ones, so `checkpoint.resume=PATH` can name
one; keep_last never prunes them.

The set travels in every checkpoint, so a restart keeps it; the metrics are identical on every rank, so every rank
decides alike whether to save (a collective) without asking the others."""

from __future__ import annotations

from pathlib import Path

from distrib.checkpoint.folder import find, listing, remove, step_of, stored_run_id


def best_name(step: int) -> str:
    return f"best_{step:08d}"


class BestCheckpoints:
    def __init__(self, keep: int, metric: str, directory: Path, is_main: bool):
        self.keep, self.metric = keep, metric
        self.directory, self.is_main = Path(directory), is_main
        self.entries: list[dict] = []  # {"step", "value"}, best first

    def _rank(self, entry: dict) -> tuple:
        # Better values first; among equals the earlier evaluation.
        sign = 1.0 if "loss" in self.metric else -1.0
        return sign * entry["value"], entry["step"]

    def consider(self, step: int, metrics: dict, checkpointer) -> Path | None:
        """Saves a best_STEP with `checkpointer` (every rank calls it) if this evaluation is among the k best, and
        deletes the one it pushes out."""
        value = metrics[self.metric]
        if any(entry["step"] == step for entry in self.entries):
            return None  # this step is kept already (its evaluation redone after a restart)
        # Its name goes into the set before the save, so the checkpoint's own copy of the set names it too.
        new = {"step": step, "value": value, "name": checkpointer.name(step, best=True)}
        entries = sorted([*self.entries, new], key=self._rank)
        if new not in entries[:self.keep]:
            return None
        self.entries, dropped = entries[:self.keep], entries[self.keep:]
        path = checkpointer.save(step, best=True)
        if self.is_main:  # only after the new one is safely in place
            for entry in dropped:
                old = find(self.directory, _name(entry))
                if old is not None:
                    remove(old)
        return path

    def state_dict(self) -> dict:
        return {"metric": self.metric, "entries": [dict(entry) for entry in self.entries]}

    def load_state_dict(self, state: dict) -> None:
        """The set as of the checkpoint; ranked by another metric before, a new set starts."""
        if state.get("metric") == self.metric:
            self.entries = sorted(state["entries"], key=self._rank)[:self.keep]

    def drop_abandoned(self, resumed_step: int, run_id: str) -> None:
        """After an automatic resume: a best_* of this run past the resumed step that the set does not hold came
        from the abandoned attempt's future, so rank 0 deletes it (if it is among the best again, the run rewrites
        it). Another run's (checkpoint.foreign=keep) stays."""
        if not self.is_main:
            return
        kept = {entry["step"] for entry in self.entries}
        for path in listing(self.directory, "best"):
            step = step_of(path)
            if step > resumed_step and step not in kept and stored_run_id(path) in (run_id, None):
                remove(path)

    def describe(self) -> list[dict]:
        return [{"step": entry["step"], "value": entry["value"],
                 "path": str(find(self.directory, _name(entry)) or self.directory / f"{_name(entry)}.pt")}
                for entry in self.entries]


def _name(entry: dict) -> str:
    """An entry's checkpoint name; entries saved before names carried run ids have none: best_STEP."""
    return entry.get("name") or best_name(entry["step"])
