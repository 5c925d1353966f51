"""Cluster environments beyond SLURM (distrib.launch.clusters): the manifests parse and carry the fields their
operators require, each environment's variables become the launch they describe, distrib doctor names it, and the
bad inputs (node ranks out of range, hosts that do not resolve, environments that disagree, nodes that never arrive)
are one line and exit 2. The runs themselves: tests/integration/test_launch.py."""

from __future__ import annotations

import os

import pytest

from distrib import cli
from distrib.cli import train as train_command
from distrib.errors import UserError
from distrib.launch import arguments, clusters, doctor
from tests.helpers.cluster_envs import (
    PYTORCHJOB,
    SKYPILOT,
    TRAINJOB,
    documents,
    pytorchjob_container,
    pytorchjob_env,
    skypilot_command,
    skypilot_env,
    trainjob_command,
    trainjob_env,
)
from tests.helpers.support import REPO, free_port

# ---------------------------------------------------------------- the manifests


def test_trainjob_manifest_has_what_kubeflow_trainer_requires():
    claim, job = documents(TRAINJOB)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob",
                                                                       "distrib-train")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed" and job["spec"]["trainer"]["numNodes"] == 2
    (override,) = job["spec"]["podTemplateOverrides"]
    assert override["targetJobs"] == [{"name": "node"}] and override["spec"]["terminationGracePeriodSeconds"] >= 60
    (volume,) = override["spec"]["volumes"]
    assert claim["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in claim["spec"]["accessModes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = override["spec"]["containers"][0]["volumeMounts"]
    assert override["spec"]["containers"][0]["name"] == "node" and mount["name"] == volume["name"]
    _assert_dirs_on(trainjob_command(), mount["mountPath"])


def test_pytorchjob_manifest_has_what_the_training_operator_requires():
    (job,) = documents(PYTORCHJOB)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob",
                                                                       "distrib-train")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 3)
    for spec in specs.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch" and container == pytorchjob_container()
        assert container["ports"][0]["name"] == "pytorchjob-port"  # the operator's MASTER_PORT comes from it
        assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= 60
        (mount,) = container["volumeMounts"]
        assert spec["template"]["spec"]["volumes"][0]["name"] == mount["name"]
        _assert_dirs_on(container["command"], mount["mountPath"])


def test_skypilot_task_runs_distrib_train_on_its_nodes():
    (task,) = documents(SKYPILOT)
    assert task["num_nodes"] == 2 and "/shared" in task["file_mounts"]
    _assert_dirs_on(skypilot_command(), "/shared")


def _assert_dirs_on(command: list[str], mount: str) -> None:
    assert command[:4] == ["distrib", "train", "--config", "configs/cluster.toml"]
    assert (REPO / command[3]).is_file()
    sets = dict(item.split("=", 1) for item in command[5::2])
    assert sets["run.dir"].startswith(mount + "/") and sets["checkpoint.dir"].startswith(mount + "/")


# ---------------------------------------------------------------- each environment's launch


@pytest.fixture
def no_launch_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("PET_", "SLURM_", "SKYPILOT_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(key)
    monkeypatch.setattr(arguments, "visible_gpu_count", lambda: 0)


def _resolved(monkeypatch, environ: dict, argv=()) -> tuple:
    for key, value in environ.items():  # torchrun's parser reads PET_* from os.environ
        monkeypatch.setenv(key, value)
    args = arguments.apply_defaults(arguments.parse_args([*argv, "train.py"]), environ)
    arguments.check_rendezvous(args, environ)
    for key in environ:
        monkeypatch.delenv(key)
    return (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr, int(args.master_port),
            args.rdzv_backend, args.standalone)


def test_trainjob_and_skypilot_variables_give_the_same_launch(no_launch_env, monkeypatch):
    for rank in (0, 1):
        trainjob = _resolved(monkeypatch, trainjob_env(rank, clusters.SKYPILOT_PORT, nproc=1))
        assert trainjob == ("2", "1", rank, "127.0.0.1", clusters.SKYPILOT_PORT, "static", False)
        assert _resolved(monkeypatch, skypilot_env(rank)) == trainjob  # CPU nodes: one worker, as torchrun
    assert _resolved(monkeypatch, skypilot_env(1, gpus=8))[1] == "8"


def test_flags_win_over_pet_and_pet_over_skypilot(no_launch_env, monkeypatch):
    mixed = {**skypilot_env(1, nnodes=2), "PET_MASTER_PORT": "1234", "PET_NPROC_PER_NODE": "3"}
    assert _resolved(monkeypatch, mixed) == ("2", "3", 1, "127.0.0.1", 1234, "static", False)
    flags = ["--nnodes", "2", "--node-rank", "0", "--master-port", "99"]
    assert _resolved(monkeypatch, mixed, flags) == ("2", "3", 0, "127.0.0.1", 99, "static", False)


def test_distrib_train_launches_under_pet_and_skypilot_but_not_inside_a_worker(no_launch_env, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(train_command, "launch_trainer", lambda flags, argv, check: started.append((flags, argv)) or 0)
    monkeypatch.setattr(train_command, "worker", lambda config: started.append("worker") or 0)
    base = dict(os.environ)
    for environ in (trainjob_env(0, 29500), skypilot_env(0), pytorchjob_env(1, 29500)):
        monkeypatch.setattr(os, "environ", {**base, **environ})
        assert cli.main(["train", "--set", "train.max_steps=3"]) == 0
    assert started == [([], ["--set", "train.max_steps=3"])] * 2 + ["worker"]


def test_doctor_names_each_environment_and_what_distrib_train_does():
    seen = {
        "none": ({}, "one process"),
        "Kubeflow TrainJob (PET_*)": (trainjob_env(0, 29500, addr="job-node-0-0.job"), "starts this node's workers"),
        "torchrun variables (PET_*)": (trainjob_env(0, 29500), "starts this node's workers"),
        "Kubeflow PyTorchJob pod (RANK, WORLD_SIZE, MASTER_*)": (pytorchjob_env(3, 29500), "runs as rank 3 of "
                                                                                            "WORLD_SIZE=4"),
        "SkyPilot": (skypilot_env(1), "starts this node's workers"),
        "SLURM": ({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}, "one process"),
        "a worker of torchrun or distrib launch": ({**trainjob_env(0, 1), "RANK": "0", "TORCHELASTIC_RUN_ID": "x"},
                                                   "runs as this one worker"),
    }
    for name, (environ, plan) in seen.items():
        assert clusters.name(environ) == name and clusters.plan(environ).startswith(plan), name
    assert doctor.check_cluster(pytorchjob_env(3, 29500), doctor.Facts()).ok
    one_gpu = doctor.Facts(num_gpus=1)
    assert doctor.check_local_rank(pytorchjob_env(3, 29500), one_gpu).ok  # the manifest's LOCAL_RANK=0
    pod = {key: value for key, value in pytorchjob_env(3, 29500).items() if not key.startswith("LOCAL_")}
    assert "set LOCAL_RANK=0" in doctor.check_local_rank(pod, one_gpu).message


def test_pytorchjob_pod_is_one_worker_on_its_own_node():
    from distrib.distributed.runtime import read_launch_env

    env = read_launch_env(pytorchjob_env(3, 29500))
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 0, 1)
    assert env.launched and not env.elastic  # its own store at MASTER_ADDR (rank 0's), no agent to die with


# ---------------------------------------------------------------- bad inputs: one line, exit 2


def _train_error(monkeypatch, tmp_path, capsys, environ: dict) -> str:
    monkeypatch.chdir(tmp_path)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["train", "--set", "train.max_steps=3"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


@pytest.mark.parametrize("environ, says", [
    (trainjob_env(2, 29500), "PET_NODE_RANK=2 is out of range for 2 node(s)"),
    (skypilot_env(3), "SKYPILOT_NODE_RANK=3 is out of range for 2 node(s)"),
    (trainjob_env(0, 29500, addr="no-such-node.invalid"), "PET_MASTER_ADDR=no-such-node.invalid: the rendezvous "
                                                          "host 'no-such-node.invalid' does not resolve"),
    ({**trainjob_env(0, 29500), "SLURM_JOB_ID": "7", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "n[1-4]"},
     "PET_NNODES=2 but SLURM_NNODES=4: PET_* would win (flags > PET_* > SLURM/SkyPilot"),
    ({**skypilot_env(0, nnodes=3), "PET_NNODES": "2"}, "PET_NNODES=2 but SKYPILOT_NUM_NODES=3"),
    ({**pytorchjob_env(1, 29500), "PET_NPROC_PER_NODE": "8"}, "a PyTorchJob pod with PET_NPROC_PER_NODE=8"),
], ids=["pet-node-rank", "skypilot-node-rank", "unresolvable", "slurm-disagrees", "skypilot-disagrees",
        "pytorchjob-nproc"])
def test_bad_cluster_variables_are_one_line(no_launch_env, monkeypatch, tmp_path, capsys, environ, says):
    assert says in _train_error(monkeypatch, tmp_path, capsys, environ)


def test_a_flag_settles_a_disagreement(no_launch_env, monkeypatch):
    environ = {**skypilot_env(0, nnodes=3), "PET_NNODES": "2"}
    with pytest.raises(UserError, match="PET_NNODES=2 but SKYPILOT_NUM_NODES=3"):
        _resolved(monkeypatch, environ)
    assert _resolved(monkeypatch, environ, ["--nnodes", "3"])[0] == "3"


def test_nodes_that_never_arrive_are_one_line(no_launch_env, monkeypatch, tmp_path, capsys):
    """PET_NNODES=2 but only this node comes: node 0's store stops waiting after the rendezvous timeout (2 s here,
    torch's 600 s by default) with one line, not the agent's traceback."""
    environ = trainjob_env(0, free_port(), nproc=1)
    line = _train_error(monkeypatch, tmp_path, capsys, {**environ, "PET_RDZV_CONF": "timeout=2"})
    assert f"rendezvous at 127.0.0.1:{environ['PET_MASTER_PORT']}: not all 2 nodes" in line and "1/2" in line
