"""Helpers for the launcher, SLURM and doctor tests: launches started together, whose whole process trees (torch's
agent puts each worker in a session of its own) are killed on timeout or failure; the small cluster config."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from support import REPO, kill_tree, load_weights, max_relative_diff

PROBE = REPO / "tests" / "probe_env.py"
CLUSTER_CONFIG = REPO / "configs" / "cluster.toml"
# configs/cluster.toml, shorter: float differences across world sizes grow with the steps.
SMALL = ["--set", "train.max_steps=20", "--set", "data.synthetic_train_size=1024",
         "--set", "data.synthetic_test_size=200"]
LAUNCH_VARS = ("PET_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_",
               "TORCHELASTIC_", "SLURM_", "OMP_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launch, SLURM or PET_* variables (CI may run inside a job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this python's `distrib`
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def distrib_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "distrib", *map(str, args)]


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def text(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f}s\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"


class Launches:
    """Starts commands at once, output to files (no pipe can fill and block); kills every tree on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = Path(log_dir), []

    def start(self, cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> int:
        name = self.log_dir / f"proc{len(self.procs)}"
        out, err = open(f"{name}.out", "w"), open(f"{name}.err", "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env or clean_env(), cwd=cwd, text=True,
                                start_new_session=True)
        self.procs.append((proc, name, time.monotonic()))
        return len(self.procs) - 1

    def wait(self, timeout: float) -> list[Done]:
        """Waits for all; on timeout kills them all and fails the test with their output."""
        deadline, results = time.monotonic() + timeout, []
        for proc, name, started in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
                raise AssertionError(f"timed out after {timeout}s: {proc.args}\n"
                                     f"{Path(f'{name}.err').read_text()[-6000:]}") from None
            results.append(Done(proc.returncode, Path(f"{name}.out").read_text(), Path(f"{name}.err").read_text(),
                                time.monotonic() - started))
        return results

    def close(self) -> None:
        for proc, _, _ in self.procs:
            kill_tree(proc)

    def __enter__(self) -> "Launches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_one(cmd: list[str], log_dir: Path, timeout: float, env: dict[str, str] | None = None) -> Done:
    with Launches(log_dir) as launches:
        launches.start(cmd, env)
        return launches.wait(timeout)[0]


def runs_relative_diff(run_a: Path, run_b: Path) -> float:
    """Largest per-tensor relative difference between two runs' model.pt (plain state_dicts)."""
    return max_relative_diff(load_weights(run_a), load_weights(run_b))


def train_reference(run_dir: Path, log_dir: Path) -> Path:
    """One process, no launcher: what every launch of configs/cluster.toml + SMALL must reproduce."""
    done = run_one(distrib_cmd("train", "--config", CLUSTER_CONFIG, *SMALL, "--set", f"run.dir={run_dir}"),
                   log_dir, timeout=180)
    assert done.returncode == 0, done.text()
    return run_dir
