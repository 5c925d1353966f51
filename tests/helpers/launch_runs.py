"""Starts tests/helpers/train_runs.py (several `distrib train` runs in one launch of workers, which pay their start-up
once) under torchrun or `distrib launch`, for tests that compare runs at world size 2 without the launch being their
point, and splits its stderr into each run's part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.processes import EVENT_S, REPO, run

TRAIN_RUNS = REPO / "tests" / "helpers" / "train_runs.py"


def launch_runs(launcher: list[str], runs: list, folder: Path, env: dict[str, str] | None = None,
                codes: Path | None = None) -> subprocess.CompletedProcess:
    """runs ([name, {VAR: VALUE}, [section.key=value, ...]]), in order, in one launch: launcher is the command before
    the script (torchrun's or distrib launch's, with its flags). The list is written to folder/runs.json; with codes,
    every run runs and train_runs.py writes each one's exit code there."""
    path = Path(folder) / "runs.json"
    path.write_text(json.dumps([[name, run_env, [str(item) for item in items]] for name, run_env, items in runs]))
    cmd = [*launcher, str(TRAIN_RUNS), str(path), *([str(codes)] if codes else [])]
    # PYTHONPATH: train_runs.py is run as a file, which sees the repository's tests.* only through it.
    return run(cmd, EVENT_S, env={"PYTHONPATH": str(REPO), **(env or {})})


def torchrun_runs(nproc: int, runs: dict[str, list[str]], folder: Path,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """runs (name: section.key=value items), in order, in one `torchrun --standalone` launch of nproc workers."""
    return launch_runs([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"],
                       [(name, {}, items) for name, items in runs.items()], folder, env)


def split_runs(stderr: str, names: list[str]) -> dict[str, str]:
    """Each run's part of the launch's stderr, from rank 0's marker of the run to its marker of the next (the process
    group's closing barrier ends a run on every rank before rank 0 starts the next)."""
    starts = [stderr.index(f"== run {name} ==") for name in names]
    return {name: stderr[start:end] for name, start, end in zip(names, starts, [*starts[1:], len(stderr)])}
