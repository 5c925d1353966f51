"""distrib launch against torchrun: the same worker environment, better defaults (private local rendezvous, GPU
count, CPU threads, SLURM), failures that end the run fast and name the rank, and multi-node training over loopback."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from distrib.errors import EXIT_HUNG, UserError
from distrib.launch import arguments
from tests.helpers.cluster_envs import (
    pytorchjob_container,
    pytorchjob_env,
    skypilot_command,
    skypilot_env,
    trainjob_command,
    trainjob_env,
)
from tests.helpers.launch_support import (
    CLUSTER_CONFIG,
    PROBE,
    REPO,
    SMALL,
    Launches,
    clean_env,
    distrib_cmd,
    run_one,
    runs_relative_diff,
    train_reference,
)
from tests.helpers.processes import EVENT_S
from tests.helpers.support import free_port, load_weights

SAME_IN_BOTH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
PER_RUN = ("MASTER_PORT", "TORCHELASTIC_RUN_ID")  # the same on every rank of a run, different between runs


# ---------------------------------------------------------------- defaults, without starting anything


@pytest.fixture
def no_launch_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("PET_", "SLURM_")):
            monkeypatch.delenv(key)
    monkeypatch.setattr(arguments, "visible_gpu_count", lambda: 0)


def _slurm_env(**extra) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[7-8]", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2", **extra}


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """An scontrol on PATH that expands only the node list the tests use."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text('#!/bin/sh\n[ "$*" = "show hostnames gpu[7-8]" ] && printf "gpu7\\ngpu8\\n" && exit 0\n'
                      'echo "unexpected: $*" >&2; exit 1\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return script


def _resolved(argv, environ=None):
    return arguments.apply_defaults(arguments.parse_args([*argv, "train.py"]), environ or {})


def test_slurm_gives_nodes_first_host_job_id_and_port(no_launch_env, fake_scontrol):
    args = _resolved(["--nproc-per-node", "2"], _slurm_env())
    assert (args.nnodes, args.rdzv_backend, args.rdzv_id) == ("2", "c10d", "4242")
    assert args.rdzv_endpoint == f"gpu7:{arguments.SLURM_PORT_BASE + 4242}"
    assert not args.standalone


def test_slurm_without_scontrol_is_an_error_not_localhost(no_launch_env, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UserError, match=r"scontrol is not on PATH.*--rdzv-endpoint"):
        _resolved([], _slurm_env())


# ---------------------------------------------------------------- real launches (2 CPU workers each)


def _probe_records(out: Path, world_size: int) -> list[dict]:
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    assert all(r["all_reduce"] == world_size for r in records)
    return records


@pytest.mark.timeout(900)
def test_workers_see_torchruns_variables_and_two_launches_started_together_both_succeed(tmp_path):
    """torchrun and two distrib launches started at once, one given --nproc-per-node, the other its PET_* form: ours
    see torchrun's variables, and the two launches pick two ports."""
    outs = {name: tmp_path / name for name in ("torchrun", "distrib", "pet")}
    for out in outs.values():
        out.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    with Launches(tmp_path) as launches:
        launches.start(list(map(str, [*torchrun, PROBE, outs["torchrun"]])))
        launches.start(distrib_cmd("launch", "--nproc-per-node", "2", PROBE, outs["distrib"]))
        launches.start(distrib_cmd("launch", PROBE, outs["pet"]), clean_env(PET_NPROC_PER_NODE="2"))
        for name, done in zip(outs, launches.wait(timeout=EVENT_S)):
            assert done.returncode == 0, f"{name}: {done.text()}"
    theirs, ours, pet = (_probe_records(out, 2) for out in outs.values())
    for rank, (t, o) in enumerate(zip(theirs, ours)):
        assert set(t) == set(o), f"rank {rank}: only torchrun {set(t) - set(o)}, only ours {set(o) - set(t)}"
        assert {k: t[k] for k in SAME_IN_BOTH} == {k: o[k] for k in SAME_IN_BOTH}
        assert o["RANK"] == o["LOCAL_RANK"] == str(rank) and o["WORLD_SIZE"] == "2"
    for records in (theirs, ours, pet):
        assert len({tuple(r[k] for k in PER_RUN) for r in records}) == 1  # one run, one port, one run id
    assert ours[0]["MASTER_PORT"] != pet[0]["MASTER_PORT"], "both launches used one port"
    assert ours[0]["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert ours[0]["MASTER_ADDR"] == "127.0.0.1"  # the one store, on loopback (torchrun names this host)


@pytest.mark.timeout(900)
def test_a_dead_worker_ends_the_whole_run_and_is_named(tmp_path):
    """Rank 1 of a plain script exits with 3 while rank 0 sleeps. (A worker killed by a signal, named as such: the
    trainer's dying rank below.)"""
    done = run_one(distrib_cmd("launch", "--nproc-per-node", "2", PROBE, tmp_path, "exit", "1"), tmp_path,
                   timeout=EVENT_S)
    # Measured from rank 1's end (it writes rank1.json just before), not from the start, which a loaded machine
    # stretches: the survivor sleeps for 600 s, so only the launcher ending the run makes this short.
    after_death = time.time() - (tmp_path / "rank1.json").stat().st_mtime
    assert after_death < 60, f"ended {after_death:.1f}s after rank 1 did\n{done.text()}"
    assert done.returncode == 3, done.text()
    assert "distrib launch: rank 1 (local rank 1, pid " in done.stderr and "exited with code 3 [first failure]" in \
        done.stderr
    assert "Traceback" not in done.stderr.split("distrib launch: rank")[-1]  # no traceback from the launcher


# ---------------------------------------------------------------- training: the weights of one process


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return train_reference(tmp_path_factory.mktemp("reference") / "run")


def _two_nodes(tmp_path: Path, run_dir: Path, *train: str, restarts: int = 0, env=None) -> str:
    """Two launchers on this machine as two nodes of 2 workers (c10d over loopback), running distrib train; returns
    their stderr."""
    endpoint = f"127.0.0.1:{free_port()}"
    node = ["launch", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            endpoint, "--rdzv-id", f"loopback-{os.getpid()}-{run_dir.name}", f"--max-restarts={restarts}"]
    with Launches(tmp_path) as launches:
        for _ in range(2):
            launches.start(distrib_cmd(*node, "-m", "distrib", "train", "--config", CLUSTER_CONFIG, *SMALL,
                                       "--set", f"run.dir={run_dir}", *train), env)
        results = launches.wait(timeout=EVENT_S)
    for done in results:
        assert done.returncode == 0, done.text()
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 4
    return "".join(done.stderr for done in results)


HSDP_NODES = ["--set", "dist.strategy=hsdp", "--set", "checkpoint.every_steps=10",
              "--set", "model.factory=tests.helpers.probe_env:network_dying_once"]


@pytest.mark.timeout(400)
def test_two_nodes_under_hsdp_train_like_one_process_through_a_killed_worker(tmp_path, reference):
    """hsdp over 2 launchers x 2 workers: shard groups of LOCAL_WORLD_SIZE = 2 (one node each), replicated across the
    nodes; checkpoints every 10 of the 20 steps. Rank 3 is SIGKILLed in step 12 (after the step-10 checkpoint); both
    launchers restart their workers, which resume from the sharded checkpoint and end where one process ends. (A
    resume after a kill is bitwise: test_fsdp.py, test_resume.py.) The launchers say once that rank 3 was killed by
    SIGKILL, "restarting (1 of 1)", the workers that lost it say so once between them, and no line names another
    rank as killed or lost (nor torch's own lines about workers it stopped)."""
    marker, run_dir = tmp_path / "died", tmp_path / "run"
    stderr = _two_nodes(tmp_path, run_dir, *HSDP_NODES, "--set", f"model.kwargs={{marker='{marker}', at_forward=12}}",
                        restarts=1, env=clean_env(PYTHONPATH=str(REPO)))
    said = [line for line in stderr.splitlines() if line.startswith("distrib launch: ")]
    [killed] = [line for line in said if "killed" in line or "lost" in line and "it lost a peer" not in line]
    assert re.fullmatch(r"distrib launch: rank 3 \(local rank 1, pid \d+\) was killed by signal 9 \(SIGKILL\); "
                        r"restarting \(1 of 1\)", killed), stderr
    # The other node's launcher: nothing, or its own rank that ended because rank 3 was gone (as the agent sees it).
    assert all(re.search(r"exited with code 69: it lost a peer.*restarting \(1 of 1\)$", line)
               for line in said if "restarting" in line and line != killed), stderr
    # The workers that lost rank 3 name it once between them (the first to claim the line), no other rank.
    assert re.findall(r"lost rank (\d+)", stderr) == ["3"], stderr
    assert "Unable to shutdown" not in stderr and "Sending process" not in stderr, stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert marker.exists() and summary["restart_count"] == 1 and summary["resumed_from_step"] == 10
    assert summary["state_bytes_per_rank"] > 0
    assert runs_relative_diff(run_dir, reference) < 1e-5


@pytest.mark.timeout(900)
@pytest.mark.parametrize("factory, code, ending", [
    ("stalling_network", EXIT_HUNG, r"exited with code 69: CollectiveTimeoutError: after step \d+: a collective "
                                    r"waited longer than dist\.timeout_s = 3 s .*did not arrive: rank 1 \(host "),
    ("dying_network", 128 + 9, r"was killed by signal 9 \(SIGKILL\)"),
], ids=["stalls", "dies"])
def test_trainer_rank_that_stalls_or_dies_ends_the_run_with_its_step_or_rank(tmp_path, factory, code, ending):
    """The trainer's own workers (which catch SIGTERM to checkpoint) still end the run fast; a stalled collective
    names the step and the rank that did not arrive instead of hanging; the survivors of a dead rank say in one line
    which peer they lost, with no traceback; no two lines are glued together."""
    done = run_one(distrib_cmd("train", "--nproc-per-node", "2", "--config", CLUSTER_CONFIG, *SMALL,
                               "--set", f"model.factory=tests.helpers.probe_env:{factory}", "--set", "dist.timeout_s=3",
                               "--set", f"run.dir={tmp_path}/run"),
                   tmp_path, timeout=EVENT_S, env=clean_env(PYTHONPATH=str(REPO), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="10",
                                                           DISTRIB_TEST_ACTED=str(tmp_path / "acted")))
    assert done.returncode == code, done.text()
    # From rank 1's stall (10 s) or death, not from the start: dist.timeout_s, the heartbeat grace, the stall, and
    # at most the agent's shutdown timeout (10 s) for the rest.
    after_act = time.time() - (tmp_path / "acted").stat().st_mtime
    assert after_act < 60, f"ended {after_act:.1f}s after rank 1 stalled or died\n{done.text()}"
    first = next(line for line in done.stderr.splitlines() if line.endswith("[first failure]"))
    assert re.search(r"distrib launch: rank \d \(local rank \d, pid \d+\) " + ending, first), done.text()
    assert "Traceback" not in done.stderr, done.text()
    assert all(line.startswith(("distrib", "[distrib]", "W", "E", "I")) for line in done.stderr.splitlines()), \
        done.text()  # lines of the ranks never glued: each starts with its writer's prefix (or torch's log level)
    if factory == "dying_network":
        assert re.search(r"^distrib: error: after step \d+: lost rank 1 \(host \S+, pid \d+, .*no heartbeat",
                         done.stderr, re.M), done.text()


# ---------------------------------------------------------------- clusters: only the variables each one gives


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory) -> Path:
    """distrib train --nproc-per-node 4: what every 4-worker cluster run below must equal bitwise (one thread per
    worker in all of them: a thread count can change a sum's order)."""
    tmp = tmp_path_factory.mktemp("four_workers")
    done = run_one(distrib_cmd("train", "--nproc-per-node", "4", "--config", CLUSTER_CONFIG, *SMALL,
                               "--set", f"run.dir={tmp / 'run'}"), tmp, timeout=EVENT_S, env=clean_env(**ONE_THREAD))
    assert done.returncode == 0, done.text()
    return tmp / "run"


ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _manifest_runs(tmp_path: Path, run_dir: Path, command: list[str], envs: list[dict]) -> None:
    """The manifest's own command (its `distrib` as this python's), on this machine's smallest config and in
    run_dir, once per node or pod with only that node's variables; every one ends with 0."""
    assert command[0] == "distrib"
    cmd = distrib_cmd(*command[1:], *SMALL, "--set", f"run.dir={run_dir}", "--set",
                      f"checkpoint.dir={run_dir / 'checkpoints'}")
    with Launches(tmp_path) as launches:
        for env in envs:
            launches.start(cmd, clean_env(**env, **ONE_THREAD))
        results = launches.wait(timeout=EVENT_S)
    for done in results:
        assert done.returncode == 0, done.text()
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 4


def _bitwise(run_dir: Path, reference_dir: Path) -> bool:
    ours, theirs = load_weights(run_dir), load_weights(reference_dir)
    return ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in theirs)


@pytest.mark.timeout(900)
def test_trainjob_and_skypilot_nodes_train_like_one_launch_of_four(tmp_path, four_workers):
    """Two nodes x 2 workers, each `distrib train` of the manifests started with only its environment's variables:
    node 0 a Kubeflow TrainJob pod (PET_*), node 1 a SkyPilot node (SKYPILOT_*: its node rank, the node count and
    the head's IP; PET_MASTER_PORT for a free port instead of the fixed one, PET_NPROC_PER_NODE for 2 workers on a
    node without GPUs). One launch checks both mappings (a 4-worker run costs ~20 CPU-s);
    tests/unit/test_clusters.py shows that each maps node rank 0 and node rank 1 to the same launch."""
    assert skypilot_command() == trainjob_command()  # one command: the runs below are both manifests' runs
    port = free_port()
    envs = [trainjob_env(0, port), {**skypilot_env(1), "PET_MASTER_PORT": str(port), "PET_NPROC_PER_NODE": "2"}]
    _manifest_runs(tmp_path, tmp_path / "run", trainjob_command(), envs)
    assert _bitwise(tmp_path / "run", four_workers)


@pytest.mark.timeout(900)
def test_pytorchjob_pods_train_like_one_launch_of_four(tmp_path, four_workers):
    """Four pods of one process each, with only what the training-operator gives them (MASTER_*, WORLD_SIZE=4,
    RANK=i) and the manifest's env: each `distrib train` is a worker already; rank 0 hosts the store."""
    port = free_port()
    _manifest_runs(tmp_path, tmp_path / "run", pytorchjob_container()["command"],
                   [pytorchjob_env(rank, port) for rank in range(4)])
    assert _bitwise(tmp_path / "run", four_workers)
