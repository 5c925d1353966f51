"""A real SLURM controller: scripts/slurm_cluster.sh brings up 2 fake nodes on this machine, scripts/slurm/train.sbatch
trains on 2 nodes x 2 CPU workers like one process, and a preemption signal requeues the job. Needs root and apt
(CI has both); deselect with -m "not slurm" for a quick local run."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.launch_support import (
    CLUSTER_CONFIG,
    REPO,
    SMALL,
    clean_env,
    run_one,
    runs_relative_diff,
    train_reference,
)

pytestmark = pytest.mark.slurm
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
LOCK = Path("/tmp/distrib-slurm-tests.lock")  # one test cluster at a time: they share this machine's munged
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The environment that reaches a fresh 2-node cluster; stopped (jobs cancelled, daemons by PID) afterwards."""
    if os.geteuid() != 0:
        pytest.fail("the SLURM tests start slurmctld/slurmd and may apt-get install them: run as root "
                    "(CI does), or deselect them with -m 'not slurm'")
    root = tmp_path_factory.mktemp("slurm")
    env = clean_env(DISTRIB_SLURM_ROOT=str(root), DISTRIB_SLURM_NODES="2", SLURM_CONF=str(root / "etc/slurm.conf"))
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # The first run installs the Debian packages: minutes, not seconds.
            up = run_one(["bash", str(CLUSTER), "up"], root, timeout=600, env=env)
            assert up.returncode == 0, f"slurm_cluster.sh up failed (a first run needs apt):\n{up.text()}"
            yield env
        finally:
            down = run_one(["bash", str(CLUSTER), "down"], root, timeout=120, env=env)
            assert down.returncode == 0, down.text()


def _slurm(env, *cmd: str) -> str:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True).stdout


def _job(env, job_id: str) -> dict[str, str]:
    fields = _slurm(env, "scontrol", "show", "job", "-o", job_id).split()
    return dict(field.split("=", 1) for field in fields if "=" in field)


def _wait(env, job_id: str, done, timeout: float, log: Path) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(env, job_id)
        if done(job):
            return job
        time.sleep(0.5)
    _slurm(env, "scancel", job_id)
    raise AssertionError(f"job {job_id} still {job.get('JobState')} after {timeout}s\n"
                         f"{log.read_text()[-5000:] if log.exists() else '(no output)'}")


def _submit(env, tmp_path: Path, *trainer_args: str) -> tuple[str, Path]:
    """sbatch as a user would: 2 nodes, 2 CPU workers per node (PET_NPROC_PER_NODE, torchrun's variable)."""
    log = tmp_path / "slurm-%j.out"
    job_id = _slurm({**env, "PET_NPROC_PER_NODE": "2"}, "sbatch", "--parsable", "--nodes=2", f"--output={log}",
                    f"--chdir={tmp_path}", str(SBATCH), str(CLUSTER_CONFIG), *trainer_args).strip()
    return job_id, Path(str(log).replace("%j", job_id))


@pytest.mark.timeout(900)
def _signal_when(env, job_id: str, log: Path, ready) -> dict[str, str]:
    """Once ready() (the job still running), SIGUSR1 to the batch script as --signal=B:USR1@120 sends it; returns
    the job once SLURM has requeued it, and cancels it either way."""
    deadline = time.monotonic() + 180
    while not ready():
        assert time.monotonic() < deadline and _job(env, job_id)["JobState"] not in ENDED, \
            log.read_text() if log.exists() else "(no output)"
        time.sleep(0.1)
    _slurm(env, "scancel", "--signal=USR1", "--batch", job_id)
    try:
        return _wait(env, job_id, lambda job: job["Restarts"] != "0", timeout=120, log=log)
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=60)


def test_sbatch_trains_on_two_nodes_like_one_process(cluster, tmp_path):
    reference = train_reference(tmp_path / "reference")
    run_dir = tmp_path / "run"
    job_id, log = _submit(cluster, tmp_path, *SMALL, "--set", f"run.dir={run_dir}")
    job = _wait(cluster, job_id, lambda job: job["JobState"] in ENDED, timeout=240, log=log)
    assert job["JobState"] == "COMPLETED", log.read_text()[-5000:]
    assert job["NumNodes"] == "2"
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 4
    assert runs_relative_diff(run_dir, reference) < 1e-5


@pytest.mark.timeout(900)
def test_a_preemption_signal_requeues_the_job(cluster, tmp_path):
    """SIGUSR1 to the batch script, as --signal=B:USR1@120 sends it: the launchers exit 75 and the job is requeued."""
    job_id, log = _submit(cluster, tmp_path, "--set", "train.max_steps=100000", "--set", "train.log_every=1",
                          "--set", f"run.dir={tmp_path}/run")
    job = _signal_when(cluster, job_id, log, lambda: "[distrib] step" in (log.read_text() if log.exists() else ""))
    text = log.read_text()
    assert "distrib launch: stopped by SIGTERM" in text and f"requeueing job {job_id}" in text, text[-5000:]
    assert job["Restarts"] == "1"


def _launchers(job_id: str) -> list[int]:
    """This machine's `distrib launch` processes of the job (both fake nodes run here)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"launch" in cmdline and f"SLURM_JOB_ID={job_id}".encode() in environ and b"distrib" in b" ".join(cmdline):
            found.append(int(proc.name))
    return found


def _handles_sigterm(pid: int) -> bool:
    """SigCgt has SIGTERM: distrib launch runs its own code (it installs its handler first, then imports torch)."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> (15 - 1) & 1)


@pytest.mark.timeout(900)
def test_a_preemption_signal_while_the_launchers_start_requeues_the_job(cluster, tmp_path):
    """SIGUSR1 to the batch script as soon as both launchers run their own code (importing torch, before any
    worker): they exit 75 at once and the job is requeued, instead of failing with 143. (In the half second before
    a launcher's interpreter runs its code, SIGTERM kills it: train.sbatch requeues that step's 143 too.)"""
    job_id, log = _submit(cluster, tmp_path, "--set", "train.max_steps=100000", "--set", f"run.dir={tmp_path}/run")
    # Both nodes' launchers run their own code (so handle SIGTERM), before any worker exists.
    job = _signal_when(cluster, job_id, log, lambda: len([p for p in _launchers(job_id) if _handles_sigterm(p)]) == 2)
    text = log.read_text()
    # The launcher's line, or the entry point's (distrib.__main__) while the CLI was still being imported.
    assert re.search(r"stopped by SIGTERM (before any worker started; exit 75|outside the training steps)", text), \
        text[-5000:]
    assert f"requeueing job {job_id}" in text and "[distrib] step" not in text, text[-5000:]
    assert job["Restarts"] == "1"
