"""`distrib plot RUN_DIR`: the curves of a run (loss, test accuracy, throughput against the step) as one PNG.

Reads only run_dir/metrics.jsonl; matplotlib is imported here, lazily, so training never needs it."""

from __future__ import annotations

import json
from pathlib import Path

from distrib.errors import UserError
from distrib.metrics.jsonl import last_attempt

PLOT_NAME = "curves.png"


def read_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: no such file; give the run.dir of a run that has logged at least one step")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(f"{path}:{number}: not a JSON line; remove or fix that line") from None
    records = last_attempt(records)  # a restarted run: one history, not the abandoned attempts' steps too
    if not any("loss" in r for r in records):
        raise UserError(f"{path}: no training steps logged yet; plot again after the first log step")
    return records


def _series(records: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and "step" in r]
    return [s for s, _ in points], [v for _, v in points]


def _panels(records: list[dict]) -> list[tuple[str, str, list]]:
    """(title, y label, [(label, steps, values, marker)]) of each panel that has data: the loss always; a
    classifier's accuracy, else a sequence model's token accuracy (a regression has neither: no panel); the speed."""
    panels = [("Loss", "train.loss", [("train loss", *_series(records, "loss"), None),
                                      ("test loss", *_series(records, "test_loss"), "o")])]
    key = next((k for k in ("test_accuracy", "test_token_accuracy") if _series(records, k)[0]), None)
    if key:
        steps, accuracy = _series(records, key)
        panels.append(("Test accuracy", "%", [(key.replace("_", " "), steps, [100 * a for a in accuracy], "o")]))
    speed = _series(records, "samples_per_second")
    if speed[0]:
        panels.append(("Throughput", "samples/s", [("samples/s (all devices)", *speed, None)]))
    return panels


def make_figure(records: list[dict]):
    """A figure of panels that share the step axis: loss, test accuracy, and samples/s (each where there is data)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no display backend
    except ImportError:
        raise UserError("distrib plot needs matplotlib; pip install 'distrib[plot]'") from None
    panels = _panels(records)
    figure = Figure(figsize=(7, 3 * len(panels)), layout="constrained")
    all_axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (title, ylabel, curves) in zip(all_axes, panels):
        for label, steps, values, marker in curves:
            axes.plot(steps, values, marker=marker, label=label)
        axes.set(title=title, ylabel=ylabel)
        axes.grid(alpha=0.3)
        axes.legend(loc="best")
    all_axes[-1].set(xlabel="optimizer step")
    return figure


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Writes the run's curves to `out` (default run_dir/curves.png); returns the path."""
    records = read_records(Path(run_dir))
    figure = make_figure(records)
    path = Path(out) if out else Path(run_dir) / PLOT_NAME
    figure.savefig(path, dpi=100)
    return path
