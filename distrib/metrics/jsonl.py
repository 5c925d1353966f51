"""run_dir/metrics.jsonl, always on: one JSON object a line, a `resume` record where a restarted run continues,
and the reader that turns the lines of several attempts into one history (what `distrib plot` draws).

Imports nothing heavy: `distrib plot` reads these files without torch."""

from __future__ import annotations

import json
from pathlib import Path

NAME = "metrics.jsonl"
RESUME = "resume"  # the value of "event" in the record a resumed attempt writes first


class JsonlLogger:
    name = "jsonl"

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / NAME
        self._file = None

    def open(self, params: dict, run_id: str | None, resumed_step: int | None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: tail -f works

    def mark_resume(self, resumed_step: int, restart_count: int) -> None:
        """Readers drop the earlier attempts' lines past `resumed_step`: those steps are trained again from here."""
        earlier = self.path.read_text().count(f'"event": "{RESUME}"')
        self.write({"event": RESUME, "step": resumed_step, "resumed_step": resumed_step, "attempt": 2 + earlier,
                    "restart_count": restart_count})

    @property
    def opened(self) -> bool:
        return self._file is not None

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")

    def log(self, step: int, values: dict) -> None:
        self.write(values)

    def summary(self, summary: dict) -> None:
        pass  # summary.json is the Recorder's own file

    def close(self, status: str = "finished") -> None:
        if self._file:
            self._file.close()
            self._file = None


def last_attempt(records: list[dict]) -> list[dict]:
    """One history from the lines of every attempt: at each `resume` record the earlier lines past the resumed step
    are dropped (that attempt's future was thrown away), and where a step was logged twice (an evaluation redone at
    the resumed step) the later line wins."""
    kept: list[dict] = []
    for record in records:
        if record.get("event") == RESUME:
            kept = [r for r in kept if r.get("step", 0) <= record["resumed_step"]]
        kept.append(record)
    seen, history = set(), []
    for record in reversed(kept):
        key = (record.get("step"), record.get("event"), "test_loss" in record, "val_loss" in record, "loss" in record)
        if key not in seen:
            seen.add(key)
            history.append(record)
    return history[::-1]
