"""Helpers for the launcher, SLURM and doctor tests: the small cluster config, the reference run, and (from
processes.py, the one runner) launches started together whose whole process trees are killed on timeout."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.processes import (  # noqa: F401 - the one runner, re-exported
    EVENT_S,
    LAUNCH_VARS,
    Done,
    Launches,
    clean_env,
    listening_addresses,
    run_one,
)
from tests.helpers.support import REPO, load_weights, max_relative_diff

PROBE = REPO / "tests" / "helpers" / "probe_env.py"
CLUSTER_CONFIG = REPO / "configs" / "cluster.toml"
# configs/cluster.toml, shorter: float differences across world sizes grow with the steps.
SMALL = ["--set", "train.max_steps=20", "--set", "data.synthetic_train_size=1024",
         "--set", "data.synthetic_test_size=200"]


def distrib_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "distrib", *map(str, args)]


def runs_relative_diff(run_a: Path, run_b: Path) -> float:
    """Largest per-tensor relative difference between two runs' model.pt (plain state_dicts)."""
    return max_relative_diff(load_weights(run_a), load_weights(run_b))


def train_reference(run_dir: Path) -> Path:
    """One process, no launcher (`distrib train` in this one, which spares a process start): what every launch of
    configs/cluster.toml + SMALL must reproduce."""
    from distrib import cli

    assert cli.main(["train", "--config", str(CLUSTER_CONFIG), *SMALL, "--set", f"run.dir={run_dir}"]) == 0
    return run_dir
