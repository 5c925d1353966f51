"""What a run tells the user: rank-0 log lines, a tqdm bar, run_dir/metrics.jsonl, run_dir/summary.json and,
if asked, TensorBoard, W&B and MLflow (metrics.loggers).

Only rank 0 writes; the other ranks hold a Recorder that does nothing, so callers need no `if rank == 0`."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from distrib.errors import UserError, say
from distrib.metrics.jsonl import JsonlLogger

# The optional loggers: the module and class of each, imported only when named, and the package every rank looks
# for at start (None: import it; torch.utils.tensorboard is always found, it is its import that needs tensorboard).
TRACKERS = {"tensorboard": ("distrib.metrics.tensorboard", "TensorBoardLogger", None),
            "wandb": ("distrib.metrics.wandb", "WandbLogger", "wandb"),
            "mlflow": ("distrib.metrics.mlflow", "MlflowLogger", "mlflow")}


class Recorder:
    def __init__(self, run_dir: Path, enabled: bool, show_progress: bool | str = True, tensorboard: bool = False,
                 metrics=None, run_ids: dict | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        # auto: a bar only on a terminal; a log file gets plain lines and no carriage returns.
        self.show_progress = enabled and (show_progress is True or show_progress == "auto" and sys.stderr.isatty())
        self.last_loss = float("nan")
        self.warn_only = metrics is not None and metrics.logger_errors == "warn"
        # Tracker name -> its run id, kept in checkpoints to continue the run; a caller's dict is filled in place.
        self.run_ids: dict[str, str] = {} if run_ids is None else run_ids
        names = logger_names(metrics, tensorboard)
        for name in names:  # every rank checks, so all fail alike and before training
            _check_installed(name)
        self._jsonl = JsonlLogger(self.run_dir)
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._pending = [_logger(name, metrics, self.run_dir) for name in names] if enabled else []
        self._trackers: list = []

    def start(self, params: dict, resumed_step: int | None = None, restart_count: int = 0) -> None:
        """Opens the loggers on rank 0 (a resumed run continues its tracker runs); every rank calls it and learns
        whether rank 0 failed, so all stop together, with one line, before the first step."""
        error = self._open_trackers(params, resumed_step) if self.enabled else None
        if self.enabled and not error:  # a run that fails here leaves metrics.jsonl as it was
            self._jsonl.open(params, None, resumed_step)
            if resumed_step is not None:
                self._jsonl.mark_resume(resumed_step, restart_count)
        error = _agree(error)
        if error:
            self.close("failed")
            raise UserError(error)

    def _open_trackers(self, params: dict, resumed_step: int | None) -> str | None:
        for logger in self._pending:
            try:
                run_id = logger.open(params, self.run_ids.get(logger.name), resumed_step)
            except UserError as e:
                if not self.warn_only:
                    return str(e)
                self.info(f"warning: {e}; continuing without {logger.name} (metrics.logger_errors = warn)")
                continue
            if run_id:
                self.run_ids[logger.name] = run_id
            self._trackers.append(logger)
        self._pending = []
        return None

    def info(self, message: str) -> None:
        if self.enabled:
            if self.show_progress:
                tqdm.write(f"[distrib] {message}", file=sys.stderr)  # above the bar, not through it
            else:  # one write to the stream's file, not print: Ray Train's print both writes and logs (twice)
                say(f"[distrib] {message}")

    def progress_bar(self, total: int, initial: int = 0) -> tqdm:
        return tqdm(total=total, initial=initial, disable=not self.show_progress, unit="step", dynamic_ncols=True,
                    file=sys.stderr, mininterval=1.0)

    def write(self, record: dict) -> None:
        if self._jsonl.opened:
            self._jsonl.write(record)
        numbers = {key: value for key, value in record.items() if key != "step" and isinstance(value, (int, float))
                   and not isinstance(value, bool)}
        self._each_tracker(lambda logger: logger.log(record["step"], numbers), f"at step {record['step']}")

    def _each_tracker(self, call, where: str) -> None:
        # A tracker that fails mid-run (a server gone) is dropped with one warning: the run and the others go on.
        for logger in list(self._trackers):
            try:
                call(logger)
            except Exception as e:  # noqa: BLE001
                self._trackers.remove(logger)
                self.info(f"warning: {logger.name} failed {where} ({type(e).__name__}: {e}); "
                          f"continuing without it; metrics.jsonl has everything")

    def log_step(self, step: int, epoch: int, loss: float, lr: float, extra_losses: dict | None = None,
                 **throughput) -> None:
        """One log line; extra_losses: the model's own beside the loss ({"aux_loss": ...}, global means);
        throughput holds distrib.throughput's window figures (samples/s, step times, MFU)."""
        self.last_loss, extra_losses = loss, extra_losses or {}
        self.write({"step": step, "epoch": epoch, "loss": loss, **extra_losses, "lr": lr, **throughput})
        speed, tokens = throughput.get("samples_per_second"), throughput.get("tokens_per_second")
        mfu = throughput.get("mfu")
        extras = "".join(f" {name} {value:.4g}" for name, value in extra_losses.items())
        self.info(f"step {step} epoch {epoch} loss {loss:.4f}{extras} lr {lr:.3g}"
                  + (f" {speed:,.0f} samples/s" if speed else "") + (f" {tokens:,.0f} tokens/s" if tokens else "")
                  + (f" MFU {100 * mfu:.2f}%" if mfu else ""))

    def log_save(self, step: int, path: Path, seconds: float) -> None:
        """A checkpoint saved after `step`: how long the save held training up (a blocking write whole; an asynchronous
        one its staging, and any wait for the write before it), as save_blocked_s beside the step's metrics."""
        self.write({"step": step, "save_blocked_s": round(seconds, 6)})
        self.info(f"saved {Path(path).name} at step {step}: training held {seconds:.3f}s")

    def log_eval(self, step: int, epoch: int, metrics: dict) -> None:
        """One record; a line per evaluated split (val_*: a validation set, test_*)."""
        self.write({"step": step, "epoch": epoch, **metrics})
        for split in ("val", "test"):
            if f"{split}_loss" not in metrics:
                continue
            ema = metrics.get(f"{split}_accuracy_ema")
            self.info(f"eval at step {step}: {split} loss {metrics[f'{split}_loss']:.4f} "
                      + (f"accuracy {100 * metrics[f'{split}_accuracy']:.2f}% " if f"{split}_accuracy" in metrics
                         else "")
                      + (f"perplexity {metrics[f'{split}_perplexity']:.4g} " if f"{split}_perplexity" in metrics
                         else "")
                      + f"over {metrics[f'{split}_count']} samples"
                      + (f" (EMA weights: {100 * ema:.2f}%)" if ema is not None else ""))

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            write_json_atomic(self.run_dir / "summary.json", summary)
        self._each_tracker(lambda logger: logger.summary(summary), "writing the summary")

    def close(self, status: str = "finished") -> None:
        """status: finished, preempted or failed (what the trackers record as the run's end)."""
        self._jsonl.close()
        self._each_tracker(lambda logger: logger.close(status), "closing")
        self._trackers = []


def headline(metrics: dict) -> str:
    """The result in a few words: the accuracy of a classifier, else the test loss (and perplexity)."""
    if "test_accuracy" in metrics:
        return f"test accuracy {100 * metrics['test_accuracy']:.2f}%"
    return f"test loss {metrics['test_loss']:.4f}" + (
        f", perplexity {metrics['test_perplexity']:.4g}" if "test_perplexity" in metrics else "")


def logger_names(metrics, tensorboard: bool = False) -> list[str]:
    """The optional loggers named (jsonl is always on); metrics.tensorboard = true is an alias of naming it."""
    names = [name for name in (metrics.loggers if metrics else ()) if name != "jsonl"]
    if (tensorboard or (metrics and metrics.tensorboard)) and "tensorboard" not in names:
        names.insert(0, "tensorboard")
    return names


def require_loggers(metrics) -> None:
    """Imports every optional logger's package that `metrics` names; the one-line error of the first missing."""
    for name in logger_names(metrics):
        importlib.import_module(TRACKERS[name][0]).require()


def _check_installed(name: str) -> None:
    module, _, package = TRACKERS[name]
    try:
        found = package is not None and importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module entry set to None
        found = False
    if not found:
        importlib.import_module(module).require()  # the import; if it fails, the logger's own one-line error


def _logger(name: str, metrics, run_dir: Path):
    module, cls, _ = TRACKERS[name]
    return getattr(importlib.import_module(module), cls)(metrics, run_dir)


def _agree(error: str | None) -> str | None:
    """Rank 0's start-up error, on every rank (a collective: every rank calls it, in the same order)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return error
    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
