"""What a run tells the user: rank-0 log lines, a tqdm bar, run_dir/metrics.jsonl and run_dir/summary.json.

Only rank 0 writes; the other ranks hold a Recorder that does nothing, so callers need no `if rank == 0`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tqdm import tqdm


class Recorder:
    def __init__(self, run_dir: Path, enabled: bool, show_progress: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.show_progress = enabled and show_progress
        self.last_loss = float("nan")
        self._file = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: tail -f works

    def info(self, message: str) -> None:
        if self.enabled:
            tqdm.write(f"[distrib] {message}", file=sys.stderr)

    def progress_bar(self, total: int, initial: int = 0) -> tqdm:
        return tqdm(total=total, initial=initial, disable=not self.show_progress, unit="step", dynamic_ncols=True,
                    file=sys.stderr, mininterval=1.0)

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")

    def log_step(self, step: int, epoch: int, loss: float, lr: float, samples_per_second: float) -> None:
        self.last_loss = loss
        self.write({"step": step, "epoch": epoch, "loss": loss, "lr": lr, "samples_per_second": samples_per_second})
        self.info(f"step {step} epoch {epoch} loss {loss:.4f} lr {lr:.3g} {samples_per_second:,.0f} samples/s")

    def log_eval(self, step: int, epoch: int, metrics: dict) -> None:
        self.write({"step": step, "epoch": epoch, **metrics})
        self.info(f"eval at step {step}: test loss {metrics['test_loss']:.4f} "
                  f"accuracy {100 * metrics['test_accuracy']:.2f}% over {metrics['test_count']} samples")

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            write_json_atomic(self.run_dir / "summary.json", summary)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
