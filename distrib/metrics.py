"""What a run tells the user: rank-0 log lines, a tqdm bar, run_dir/metrics.jsonl, run_dir/summary.json and,
if asked, TensorBoard scalars in run_dir/tensorboard.

Only rank 0 writes; the other ranks hold a Recorder that does nothing, so callers need no `if rank == 0`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from distrib.errors import UserError


class Recorder:
    def __init__(self, run_dir: Path, enabled: bool, show_progress: bool = True, tensorboard: bool = False):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.show_progress = enabled and show_progress
        self.last_loss = float("nan")
        self._file = self._board = None
        writer_class = _tensorboard_writer() if tensorboard else None  # every rank checks, so all fail alike
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered: tail -f works
            if writer_class:
                self._board = writer_class(log_dir=str(self.run_dir / "tensorboard"))

    def info(self, message: str) -> None:
        if self.enabled:
            tqdm.write(f"[distrib] {message}", file=sys.stderr)

    def progress_bar(self, total: int, initial: int = 0) -> tqdm:
        return tqdm(total=total, initial=initial, disable=not self.show_progress, unit="step", dynamic_ncols=True,
                    file=sys.stderr, mininterval=1.0)

    def write(self, record: dict) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
        if self._board:
            for key, value in record.items():
                if key not in ("step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._board.add_scalar(_board_tag(key), value, record["step"])

    def log_step(self, step: int, epoch: int, loss: float, lr: float, **throughput) -> None:
        """One log line; throughput holds distrib.throughput's window figures (samples/s, step times, MFU)."""
        self.last_loss = loss
        self.write({"step": step, "epoch": epoch, "loss": loss, "lr": lr, **throughput})
        speed = throughput.get("samples_per_second")
        mfu = throughput.get("mfu")
        self.info(f"step {step} epoch {epoch} loss {loss:.4f} lr {lr:.3g}"
                  + (f" {speed:,.0f} samples/s" if speed else "") + (f" MFU {100 * mfu:.2f}%" if mfu else ""))

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
        if self._board:
            self._board.close()
            self._board = None


def _board_tag(key: str) -> str:
    """TensorBoard groups scalars by the part before '/': test/accuracy, train/loss, throughput/mfu."""
    if key.startswith("test_"):
        return f"test/{key[5:]}"
    return f"train/{key}" if key in ("loss", "lr") else f"throughput/{key}"


def _tensorboard_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("metrics.tensorboard = true: the tensorboard package is not installed; "
                        "pip install 'distrib[tensorboard]', or --set metrics.tensorboard=false") from None
    return SummaryWriter


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
