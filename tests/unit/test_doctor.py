"""distrib doctor: each misconfiguration caught by its check (fake environments, no processes), and the command's exit
status on a bad and on a clean environment."""

from __future__ import annotations

import socket

import pytest

from distrib.launch.doctor import (
    Facts,
    check_local_rank,
    check_master_addr,
    check_port,
    check_scontrol,
    check_slurm_tasks,
    check_store,
    port_in_use,
    run_checks,
)

CPU = Facts(num_gpus=0)
TWO_GPUS = Facts(num_gpus=2)


def test_local_rank_beyond_the_visible_gpus_fails_with_the_fix():
    found = check_local_rank({"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, TWO_GPUS)
    assert not found.ok
    assert "LOCAL_RANK=3 but 2 CUDA device(s)" in found.message and "--nproc-per-node=2" in found.message
    assert not check_local_rank({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, TWO_GPUS).ok
    assert check_local_rank({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, TWO_GPUS).ok
    assert check_local_rank({"LOCAL_RANK": "3"}, CPU).ok  # CPU workers need no device each


@pytest.mark.parametrize("env", [
    {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
    {"MASTER_ADDR": "127.0.1.1", "SLURM_NNODES": "2"},  # what `hostname --ip-address` gives on Debian
    {"MASTER_ADDR": "localhost", "NNODES": "2"},
    {"PET_MASTER_ADDR": "::1", "PET_NNODES": "1:3"},
    {"PET_RDZV_ENDPOINT": "127.0.0.1:29400", "GROUP_WORLD_SIZE": "2"},
])
def test_loopback_master_on_a_multi_node_run_fails(env):
    found = check_master_addr(env, CPU)
    assert not found.ok and "loopback" in found.message and "scontrol show hostnames" in found.message


@pytest.mark.parametrize("env", [
    {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},  # one node: loopback is right
    {"MASTER_ADDR": "node017", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"},
    {},
])
def test_reachable_or_single_node_master_passes(env):
    assert check_master_addr(env, CPU).ok


@pytest.mark.parametrize("env, where", [({}, "loopback only"), ({"SLURM_NNODES": "4"}, "--rdzv-endpoint address")])
def test_doctor_says_the_store_has_no_authentication(env, where):
    found = check_store(env, CPU)
    assert found.ok and "no authentication" in found.message and where in found.message


def test_a_busy_master_port_fails_and_a_free_one_passes():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        facts = Facts(port_in_use=port_in_use)
        found = check_port({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, facts)
        assert not found.ok and f"MASTER_PORT={port} is already in use" in found.message
        assert not check_port({"PET_MASTER_PORT": str(port)}, facts).ok
        # Inside a launched worker the launcher's own store holds the port; on another host we cannot tell.
        assert check_port({"MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "x"}, facts).ok
        assert check_port({"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": str(port)}, facts).ok
    assert check_port({"MASTER_PORT": str(port)}, facts).ok  # closed again
    assert check_port({}, facts).ok
    assert not check_port({"MASTER_PORT": "http"}, facts).ok


def test_missing_scontrol_inside_slurm_fails():
    found = check_scontrol({"SLURM_JOB_ID": "7"}, Facts(has_scontrol=False))
    assert not found.ok and "scontrol is not on PATH" in found.message and "--rdzv-endpoint" in found.message
    assert check_scontrol({"SLURM_JOB_ID": "7"}, Facts(has_scontrol=True)).ok
    assert check_scontrol({}, Facts(has_scontrol=False)).ok


def test_several_slurm_tasks_per_node_and_several_workers_per_task_fails():
    found = check_slurm_tasks({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "4"}, CPU, nproc_per_node=4)
    assert not found.ok and "16 per node" in found.message and "--ntasks-per-node=1" in found.message
    steps = {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2"}
    assert not check_slurm_tasks(steps, CPU, nproc_per_node=2).ok
    assert check_slurm_tasks({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "4"}, CPU, nproc_per_node=1).ok
    assert check_slurm_tasks({"SLURM_JOB_ID": "7", "SLURM_NTASKS_PER_NODE": "1"}, CPU, nproc_per_node=8).ok
    assert check_slurm_tasks({}, CPU, nproc_per_node=8).ok


def test_all_checks_run_and_pass_on_an_empty_environment():
    findings = run_checks({}, CPU, nproc_per_node=1)
    assert len(findings) == 7 and all(f.ok for f in findings)
