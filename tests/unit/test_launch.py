"""distrib launch against torchrun: the same worker environment, better defaults (private local rendezvous, GPU
count, CPU threads, SLURM), failures that end the run fast and name the rank, and multi-node training over loopback."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from distrib.distributed.host_heap import return_freed_memory
from distrib.distributed.runtime import collective_timeouts
from distrib.errors import EXIT_HUNG, EXIT_PREEMPTED, CollectiveTimeoutError, PeerLostError, UserError
from distrib.launch import arguments, environment, exits, launcher, reporting

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


def test_single_node_gets_a_private_local_rendezvous_and_one_cpu_worker(no_launch_env):
    args = _resolved([])
    assert (args.standalone, args.nproc_per_node, args.nnodes) == (True, "1", "1:1")


def test_workers_default_to_the_visible_gpus(no_launch_env, monkeypatch):
    monkeypatch.setattr(arguments, "visible_gpu_count", lambda: 4)
    assert _resolved([]).nproc_per_node == "4"


def test_explicit_rendezvous_and_pet_variables_are_kept(no_launch_env, monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    args = _resolved(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5", "--rdzv-id", "x"])
    assert (args.standalone, args.nproc_per_node, args.nnodes) == (False, "3", "2")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "h:5", "x")
    monkeypatch.setenv("PET_STANDALONE", "1")
    assert _resolved([]).standalone


def test_slurm_flags_given_by_the_user_win(no_launch_env, fake_scontrol, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # scontrol is not needed when the endpoint is given
    args = _resolved(["--nnodes", "3", "--rdzv-endpoint", "head:29400", "--rdzv-id", "mine"], _slurm_env())
    assert (args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.rdzv_backend) == ("3", "head:29400", "mine", "c10d")


def test_slurm_batch_shell_without_srun_is_an_error(no_launch_env, fake_scontrol):
    env = _slurm_env()
    del env["SLURM_STEP_ID"]
    with pytest.raises(UserError, match="srun --ntasks-per-node=1"):
        _resolved([], env)


def test_slurm_more_tasks_than_nodes_is_an_error(no_launch_env, fake_scontrol):
    with pytest.raises(UserError, match="8 tasks on 2 nodes"):
        _resolved([], _slurm_env(SLURM_STEP_NUM_TASKS="8"))


def test_slurm_single_node_job_uses_the_local_rendezvous(no_launch_env, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    args = _resolved([], _slurm_env(SLURM_NNODES="1", SLURM_JOB_NODELIST="gpu7"))
    assert args.standalone and args.nnodes == "1:1"


def test_cpu_workers_share_the_cores_unless_the_user_chose():
    cores = len(os.sched_getaffinity(0))
    assert environment.cpu_threads({}, 2, num_gpus=0) == str(max(1, cores // 2))
    assert environment.cpu_threads({}, 10 * cores, num_gpus=0) == "1"
    assert environment.cpu_threads({"OMP_NUM_THREADS": "7"}, 2, num_gpus=0) is None
    assert environment.cpu_threads({}, 2, num_gpus=2) is None  # GPU workers: torchrun's default


def test_more_cpu_workers_than_cores_is_a_warning():
    line = environment.oversubscribed(16, num_gpus=0, num_cores=2)
    assert line == ("distrib launch: warning: --nproc-per-node 16 starts 16 CPU workers (no GPU is visible) on 2 "
                    "cores: they take turns on the cores and each step waits for the slowest; --nproc-per-node 2 or "
                    "fewer gives each worker a core of its own")
    assert environment.oversubscribed(2, num_gpus=0, num_cores=2) is None
    assert environment.oversubscribed(16, num_gpus=8, num_cores=2) is None  # GPU workers: the cores only feed them
    assert environment.oversubscribed(len(os.sched_getaffinity(0)), num_gpus=0) is None


def _resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's allocator only")
def test_cpu_workers_give_freed_host_tensors_back_unless_the_user_tuned_glibc():
    """What FSDP gathers and frees block by block on the CPU must not stay in the heap (docs/parallelism.md, "What each
    rank holds"): freed tensors of 1 to 8 MiB go back to the system at once."""
    assert not return_freed_memory({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert not return_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"})
    assert return_freed_memory({})
    torch.ones(16)  # torch's code for it is paged in
    before = _resident_bytes()
    for mib in (8, 1, 4, 2, 8, 3):  # glibc's default threshold rises to 8 MiB, then keeps the smaller ones (8 MiB)
        block = torch.ones(mib * 2**18)
        del block
    assert _resident_bytes() - before < 2**20


def test_a_failure_every_rank_shares_is_one_line(tmp_path):
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "ConfigError: train.global_batch_size = 63: ...",
                                                  "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "5"}}}))
    failures = {rank: ProcessFailure(rank, 100 + rank, 2, str(error_file)) for rank in range(3)}
    failures[3] = ProcessFailure(3, 103, EXIT_PREEMPTED, "/nonexistent")  # stopped by the agent while starting
    lines = reporting.failure_lines(ChildFailedError("train", failures))
    assert lines == ["distrib launch: rank 3 (local rank 3, pid 103) was stopped by the launcher when the first "
                     "failure ended the run",
                     "distrib launch: ranks 0, 1, 2 (pids 100, 101, 102) exited with code 2: ConfigError: "
                     "train.global_batch_size = 63: ... [first failure]"]


def test_failure_summary_is_one_line_per_rank_first_failure_last(tmp_path):
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "ValueError: bad batch\nmore",
                                                  "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "5"}}}))
    failures = {0: ProcessFailure(0, 100, -signal.SIGTERM, "/nonexistent"),
                3: ProcessFailure(1, 101, 3, str(error_file))}
    error = ChildFailedError("train", failures)
    lines = reporting.failure_lines(error, {101: 201})  # lifeline pid 101 ran worker pid 201
    assert lines[1] == "distrib launch: rank 3 (local rank 1, pid 201) exited with code 3: ValueError: bad batch " \
                       "[first failure]"
    assert lines[0] == "distrib launch: rank 0 (local rank 0, pid 100) was stopped by the launcher when the first " \
                       "failure ended the run"  # SIGTERMed by the agent: no failure of its own
    assert exits.exit_code(error) == 3
    assert exits.exit_code(ChildFailedError("train", {0: failures[0]})) == 128 + signal.SIGTERM  # no checkpoint
    assert exits.signal_exit_code(signal.SIGTERM) == EXIT_PREEMPTED
    assert exits.signal_exit_code(signal.SIGKILL) == 128 + 9


def _failure(tmp_path, rank: int, exitcode: int, message: str, timestamp: int) -> ProcessFailure:
    """rank's failure as torch's agent reads it: its exit code, and the error file @record wrote (when it ended in
    Python: message, and when)."""
    error_file = tmp_path / f"error-{rank}.json"
    error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "Traceback ...",
                                                                                  "timestamp": str(timestamp)}}}))
    return ProcessFailure(rank, 100 + rank, exitcode, str(error_file))


def test_workers_preempted_by_sigterm_are_a_preemption_not_a_failure(tmp_path):
    """SIGTERM to the workers only: each checkpoints and ends with 75 (rank 2 first); the launcher says they were
    preempted and the run too, exits 75, and no line calls it a failure."""
    failures = {rank: _failure(tmp_path, rank, EXIT_PREEMPTED, "Preempted: 75", 10 + (rank + 2) % 4)
                for rank in range(4)}
    error = ChildFailedError("train", failures)
    lines = reporting.failure_lines(error)
    assert lines == ["distrib launch: ranks 0, 1, 2, 3 (pids 100, 101, 102, 103) were preempted (exit 75: "
                     "checkpointed, or stopped before training)",
                     "distrib launch: the run was preempted; exit 75: requeue the job and it resumes from its last "
                     "checkpoint"]
    assert exits.exit_code(error) == EXIT_PREEMPTED
    failures[3] = ProcessFailure(3, 103, -signal.SIGTERM, "/nonexistent")  # one the launcher's SIGTERM killed
    lines = reporting.failure_lines(ChildFailedError("train", failures))
    assert lines[0].startswith("distrib launch: ranks 0, 1, 2 (pids 100, 101, 102) were preempted (exit 75"), lines
    assert lines[1] == "distrib launch: rank 3 (local rank 3, pid 103) was stopped by the launcher when the " \
                       "preemption ended the run"
    assert not any("failure" in line for line in lines), lines


def test_a_rank_that_fails_during_a_preemption_is_the_failure_and_stopped_ranks_are_plural(tmp_path):
    failures = {rank: _failure(tmp_path, rank, EXIT_PREEMPTED, "Preempted: 75", 10 + rank) for rank in range(3)}
    failures[3] = _failure(tmp_path, 3, 1, "OSError: disk full", 20)  # ended after rank 0's preemption, failed
    error = ChildFailedError("train", failures)
    assert reporting.failure_lines(error) == [
        "distrib launch: ranks 0, 1, 2 (pids 100, 101, 102) were preempted (exit 75: checkpointed, or stopped before "
        "training)",
        "distrib launch: rank 3 (local rank 3, pid 103) exited with code 1: OSError: disk full [first failure]"]
    assert exits.exit_code(error) == 1  # not a preemption: the job script must not requeue it as one
    failures = {rank: _failure(tmp_path, rank, EXIT_PREEMPTED, "Preempted: 75", 20 + rank) for rank in range(1, 4)}
    failures[0] = _failure(tmp_path, 0, 2, "ConfigError: bad", 10)
    assert reporting.failure_lines(ChildFailedError("train", failures))[0] == \
        "distrib launch: ranks 1, 2, 3 (pids 101, 102, 103) were stopped by the launcher when the first failure " \
        "ended the run"


def test_ranks_the_agent_killed_after_its_grace_are_stopped_by_the_launcher_not_failures():
    """Rank 1 SIGKILLed (its lifeline recorded -9, then ended alike); rank 2 waited in a collective for it past the
    agent's grace and was SIGKILLed with its lifeline (no code recorded): only rank 1 is a failure."""
    failures = {0: ProcessFailure(0, 100, -signal.SIGTERM, "/nonexistent"),
                1: ProcessFailure(1, 101, -signal.SIGKILL, "/nonexistent"),
                2: ProcessFailure(2, 102, -signal.SIGKILL, "/nonexistent")}
    failures[1].timestamp = failures[0].timestamp - 30
    lines = reporting.failure_lines(ChildFailedError("train", failures), {}, {102})
    assert lines == ["distrib launch: ranks 0, 2 (pids 100, 102) were stopped by the launcher when the first failure "
                     "ended the run",
                     "distrib launch: rank 1 (local rank 1, pid 101) was killed by signal 9 (SIGKILL) [first failure]"]


def test_a_restart_names_the_rank_that_died_and_its_signal_once_and_no_rank_the_launcher_stopped(tmp_path):
    """Attempt 0 of --max-restarts 1 at world 4: rank 1 SIGKILLed first; rank 3 lost it (69) and rank 0 ended with
    the launcher's SIGTERM after it; rank 2 outlived the agent's grace and was SIGKILLed with its lifeline (no
    code). The lifelines' statuses, as the launcher reads them when torch's agent logs the failure: one line, rank 1
    and SIGKILL, "restarting (1 of 1)"; none on the last attempt, where failure_lines says how the run ended."""
    from distrib.launch.lifeline import Status, read_attempt, write_status
    from distrib.launch.reporting import restart_line

    for rank, code, ended_s in ((0, -signal.SIGTERM, 12), (1, -signal.SIGKILL, 10), (2, None, None), (3, 69, 11)):
        write_status(tmp_path, "0", Status(100 + rank, 200 + rank, code, rank, rank, ended_s and ended_s * 10**9))
    attempt, statuses = read_attempt(tmp_path)
    assert attempt == 0 and sorted(s.rank for s in statuses) == [0, 1, 2, 3]
    assert restart_line(attempt, statuses, 1) == \
        "distrib launch: rank 1 (local rank 1, pid 201) was killed by signal 9 (SIGKILL); restarting (1 of 1)"
    assert restart_line(1, statuses, 1) is None
    assert restart_line(0, [statuses[0], statuses[3]], 1) == (  # another node's: its ranks lost rank 1
        "distrib launch: rank 3 (local rank 3, pid 203) exited with code 69: it lost a peer, or waited for a hung one "
        "(a worker's line above names which); restarting (1 of 1)")
    write_status(tmp_path, "1", Status(104, 204, 1, 4, 0, 5))  # another node's rank 4, on the second of 3 attempts
    assert restart_line(*read_attempt(tmp_path), 3) == \
        "distrib launch: rank 4 (local rank 0, pid 204) exited with code 1; restarting (2 of 3)"


def test_torchs_lines_about_failed_and_stopped_workers_are_left_out_and_a_failure_is_heard():
    """torch's agent logs "failed (exitcode ...)" once it stopped a failed attempt's workers: the launcher's cue for
    restart_line; that line, "Sending process ... closing signal" and "Unable to shutdown process ... via 15" are
    left out (the launcher's lines say who failed)."""
    import logging

    from distrib.launch.reporting import quiet_torch_failure_lines

    heard, logger = [], logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    records = [logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, args, None) for msg, args in (
        ("Sending process %s closing signal %s", (12, "SIGTERM")),
        ("Unable to shutdown process %s via %s, forcefully exiting via %s", (12, 15, 9)),
        ("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", (-9, 1, 12, "python")),
        ("Process %s did not exit after %s within %ss", (12, "SIGKILL", 30)))]
    with quiet_torch_failure_lines(lambda: heard.append(1)):
        kept = [record.msg for record in records if logger.filter(record)]
    assert kept == ["Process %s did not exit after %s within %ss"] and heard == [1]
    assert all(logger.filter(record) for record in records)  # outside: as torch logs them


def test_a_collective_timeout_or_lost_peer_names_the_step_and_other_errors_pass_through():
    with pytest.raises(CollectiveTimeoutError, match=r"^after step 7: a collective waited longer than "
                                                      r"dist.timeout_s = 3 s \(Timed out waiting 3000ms") as caught:
        with collective_timeouts(3.0, lambda: "after step 7"):
            raise RuntimeError("[/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")
    assert caught.value.exit_code == EXIT_HUNG
    with pytest.raises(PeerLostError, match=r"^after step 7: lost a peer \(Connection closed by peer \[h\]:1\.\)"):
        with collective_timeouts(3.0, lambda: "after step 7"):
            raise RuntimeError("[pair.cc:1] Connection closed by peer [h]:1. This is typically caused by ...")
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"):
        with collective_timeouts(3.0, lambda: "after step 7"):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def test_the_rendezvous_store_binds_only_the_endpoint_address():
    """distrib launch's store socket: bound to the address named (never *), None for another machine's address (a
    client then) or for a port another launcher on this machine already serves."""
    from distrib.launch.rendezvous import _bound_listener

    listener = _bound_listener("127.0.0.1", 0)
    try:
        host, port = listener.getsockname()
        assert host == "127.0.0.1" and port > 0
        assert _bound_listener("127.0.0.1", port) is None  # served already: this launcher is a client
    finally:
        listener.close()
    assert _bound_listener("192.0.2.1", 29400) is None  # TEST-NET-1: not an address of this machine


def test_distrib_train_takes_the_launchers_flags_with_their_meaning(monkeypatch, tmp_path):
    """Each flag distrib train passes on is one of torch's launcher flags, with the same arity; distrib train hands
    them to distrib launch as given, and its workers run the rest of the command line."""
    from torch.distributed.run import get_args_parser

    from distrib import cli
    from distrib.cli import train as train_command

    torchrun = {flag: action.nargs != 0 for action in get_args_parser()._actions for flag in action.option_strings}
    assert {flag: torchrun.get(flag) for flag in launcher.TRAIN_FLAGS} == launcher.TRAIN_FLAGS
    monkeypatch.chdir(tmp_path)  # the default run.dir is checked (not written)
    started = []
    monkeypatch.setattr(train_command, "launch_trainer", lambda flags, argv, check: started.append((flags, argv)) or 0)
    argv = ["train", "--nproc-per-node", "2", "--max-restarts=1", "--set", "train.max_steps=3", "--standalone",
            "--rdzv-conf", "join_timeout=60", "--nnodes", "1"]
    assert cli.main(argv) == 0
    assert started == [(["--nproc-per-node", "2", "--nnodes", "1", "--max-restarts", "1", "--standalone",
                         "--rdzv-conf", "join_timeout=60"], ["--set", "train.max_steps=3"])]
    assert cli.main(["train", "--max-restarts", "1"]) == 0  # any of them launches (workers: one per GPU, else 1)
    assert started[-1] == (["--max-restarts", "1"], [])
