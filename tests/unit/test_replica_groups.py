"""Replica groups on the launcher's side, without starting anything: the flags and their checks (one line each), each
group's arguments and environment, the run's exit code, and how the parent stops the groups when one fails."""

from __future__ import annotations

import os
import re
import signal

import pytest

from distrib import cli
from distrib.errors import EXIT_PREEMPTED, UserError
from distrib.launch import arguments, group_launches, lighthouse, replica_groups
from distrib.launch.group_launches import ReplicaGroups


@pytest.fixture
def no_launch_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(("PET_", "SLURM_", "SKYPILOT_")) or key in (replica_groups.GROUP_VAR,
                                                                     replica_groups.LIGHTHOUSE_VAR, "RANK"):
            monkeypatch.delenv(key)
    monkeypatch.setattr(arguments, "visible_gpu_count", lambda: 0)


def _settled(argv, environ=None, num_workers=None):
    args = arguments.apply_defaults(arguments.parse_args([*argv, "train.py", "--lr", "1"]), {})
    replica_groups.settle(args, num_workers or arguments.local_world_size(args.nproc_per_node), environ or {})
    return args


def test_the_flags_are_distrib_launchs_own_and_the_script_keeps_its_arguments(no_launch_env):
    args = _settled(["--replica-groups", "2", "--min-replicas", "2", "--nproc-per-node", "4"])
    assert (args.replica_groups, args.min_replicas, args.replica_group, args.lighthouse) == (2, 2, None, None)
    assert replica_groups.starts_groups(args) and args.training_script_args == ["--lr", "1"]
    assert not replica_groups.starts_groups(_settled(["--nproc-per-node", "4"]))


def test_groups_that_do_not_divide_the_workers_are_one_line_naming_the_key(no_launch_env):
    with pytest.raises(UserError) as e:
        _settled(["--replica-groups", "3", "--nproc-per-node", "4"])
    assert str(e.value) == ("dist.fault_tolerant_groups = 3 (--replica-groups 3) does not divide the 4 workers of "
                            "--nproc-per-node 4: each replica group takes W / G of them; give a G that divides 4 "
                            "(1, 2, 4) or --nproc-per-node 6")


@pytest.mark.parametrize("argv, message", [
    (["--replica-groups", "2", "--min-replicas", "3"], "dist.min_replicas = 3 (--min-replicas 3): must be between 1"),
    (["--replica-groups", "0"], "dist.fault_tolerant_groups = 0 (--replica-groups 0): must be at least 1"),
    (["--replica-groups", "2", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"],
     "--replica-groups 2 with --nnodes 2: one distrib launch starts the groups of one node; across nodes run one"),
    (["--replica-groups", "2", "--master-port", "29500"], "--replica-groups 2 with --rdzv-endpoint or --master-port: "
     "each replica group takes a private rendezvous"),
    (["--replica-group", "1"], "--replica-group 1 (DISTRIB_REPLICA_GROUP) without a Lighthouse: give --lighthouse"),
    (["--replica-groups", "2", "--replica-group", "2", "--lighthouse", "http://h:1"], "--replica-group 2 "
     "(DISTRIB_REPLICA_GROUP): must be 0 .. 1"),
])
def test_group_flags_that_cannot_work_are_one_line(no_launch_env, argv, message):
    with pytest.raises(UserError, match="^" + re.escape(message)):
        _settled([*argv, "--nproc-per-node", "2"])


def test_one_group_of_a_run_across_nodes_reads_its_index_and_lighthouse_from_the_environment(no_launch_env):
    environ = {replica_groups.GROUP_VAR: "1", replica_groups.LIGHTHOUSE_VAR: "http://head:29510"}
    args = _settled(["--replica-groups", "2", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"],
                    environ)  # several nodes are fine for one group
    assert not replica_groups.starts_groups(args)
    assert replica_groups.worker_env(args) == environ
    assert replica_groups.worker_env(_settled([])) == {}
    with pytest.raises(UserError, match=r"^DISTRIB_REPLICA_GROUP='one': not a whole number"):
        _settled([], {replica_groups.GROUP_VAR: "one"})


def test_each_group_launches_its_share_with_its_index_the_lighthouse_and_a_role(no_launch_env):
    argv = ["--nproc_per_node=4", "--replica-groups", "2", "--max-restarts", "3", "-m", "distrib", "train",
            "--nproc-per-node", "9"]
    args = arguments.parse_args(argv)
    child = group_launches.group_argv(argv, args, 1, 2, "http://127.0.0.1:5")
    assert child[-4:] == ["distrib", "train", "--nproc-per-node", "9"]  # the worker's own arguments untouched
    parsed = arguments.parse_args(child)  # later flags win: the group's share beats the user's 4
    assert (parsed.nproc_per_node, parsed.replica_group, parsed.lighthouse, parsed.role) == \
        ("2", 1, "http://127.0.0.1:5", "replica_group_1")
    assert (parsed.max_restarts, parsed.module, parsed.training_script) == (3, True, "distrib")


def test_each_group_gets_its_own_gpus():
    assert group_launches.group_env({}, 1, 2, num_gpus=4) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert group_launches.group_env({"CUDA_VISIBLE_DEVICES": "7,5,3,1"}, 0, 2, 4) == {"CUDA_VISIBLE_DEVICES": "7,5"}
    assert group_launches.group_env({}, 1, 2, num_gpus=0) == {}


def test_the_runs_exit_code_is_the_first_failure_else_a_preemption():
    assert group_launches.combined_exit_code([0, 0]) == 0
    assert group_launches.combined_exit_code([0, EXIT_PREEMPTED]) == EXIT_PREEMPTED
    assert group_launches.combined_exit_code([EXIT_PREEMPTED, 1, 143]) == 1
    assert group_launches.shell_code(-9) == 137 and group_launches.shell_code(3) == 3


def test_a_groups_lines_name_it(no_launch_env):
    args = _settled(["--replica-group", "1", "--lighthouse", "http://h:1"])
    lines = "distrib launch: rank 0 (local rank 0, pid 5) exited with code 1\ndistrib launch: hang: rank 1 did not"
    assert replica_groups.tagged(args, lines) == ("distrib launch: replica group 1: rank 0 (local rank 0, pid 5) "
                                                  "exited with code 1\ndistrib launch: replica group 1: hang: rank 1 "
                                                  "did not")
    assert replica_groups.tagged(_settled([]), lines) == lines


class FakeProcess:
    """A Popen whose exit code a test sets; records the signals sent to it."""

    def __init__(self):
        self.returncode, self.signals = None, []

    def poll(self):
        return self.returncode

    def send_signal(self, signum):
        if self.returncode is None:
            self.signals.append(signum)


def _run(num_groups: int) -> tuple[ReplicaGroups, list[FakeProcess], FakeProcess]:
    lighthouse = FakeProcess()
    run = ReplicaGroups(lighthouse)
    run.groups = [FakeProcess() for _ in range(num_groups)]
    return run, run.groups, lighthouse


def _ending(run, when_polled: dict[int, tuple[FakeProcess, int]]):
    """run.wait with the processes ending on the given polls of the wait loop (its sleep is the clock)."""
    polls = iter(range(1000))

    def tick(_):
        number = next(polls)
        if number in when_polled:
            proc, code = when_polled[number]
            proc.returncode = code
    return tick


def test_a_group_whose_restarts_are_spent_ends_the_run(monkeypatch, capsys):
    run, (group0, group1, group2), _ = _run(3)
    monkeypatch.setattr(group_launches.time, "sleep", _ending(run, {0: (group1, 1), 1: (group0, EXIT_PREEMPTED),
                                                                    2: (group2, EXIT_PREEMPTED)}))
    ended = run.wait()
    assert ended == [("group 1", 1), ("group 0", EXIT_PREEMPTED), ("group 2", EXIT_PREEMPTED)]
    assert group0.signals == group2.signals == [signal.SIGTERM] and group1.signals == []
    assert capsys.readouterr().err == ("distrib launch: replica group 1 ended with exit 1 (its --max-restarts spent, "
                                       "or stopped); stopping the other replica groups (SIGTERM: they checkpoint and "
                                       "stop)\n")
    assert group_launches.combined_exit_code([code for _, code in ended]) == 1


def test_groups_that_finish_leave_the_others_running(monkeypatch, capsys):
    run, (group0, group1), _ = _run(2)
    monkeypatch.setattr(group_launches.time, "sleep", _ending(run, {0: (group0, 0), 3: (group1, 0)}))
    assert run.wait() == [("group 0", 0), ("group 1", 0)]
    assert group1.signals == [] and capsys.readouterr().err == ""


def test_a_stop_signal_goes_to_every_group_and_a_preemption_is_no_failure(monkeypatch, capsys):
    run, (group0, group1), _ = _run(2)
    monkeypatch.setattr(group_launches.time, "sleep", _ending(run, {0: (group0, EXIT_PREEMPTED),
                                                                    1: (group1, EXIT_PREEMPTED)}))
    run.forward(signal.SIGUSR1)
    assert group0.signals == group1.signals == [signal.SIGUSR1]
    ended = run.wait()
    assert capsys.readouterr().err == ""  # a group's 75 after a stop signal is no failure to announce
    code = group_launches.combined_exit_code([code for _, code in ended])
    assert code == EXIT_PREEMPTED
    assert group_launches.end_line(run.stop_signal, ended, code, None) == (
        "distrib launch: stopped by SIGUSR1, passed on to every replica group (in the order they ended: group 0 exit "
        "75, group 1 exit 75); exit 75")


def test_a_lost_lighthouse_is_said_once_and_the_groups_it_stopped_make_the_runs_code(monkeypatch, capsys):
    """No signal: each group's quorum gives up on its own, and the group checkpoints and ends 75 (resumable)."""
    run, (group0, group1), lighthouse_proc = _run(2)
    monkeypatch.setattr(group_launches.time, "sleep", _ending(run, {0: (lighthouse_proc, -9), 1: (group0, 75),
                                                                    2: (group1, 75)}))
    ended = run.wait()
    assert ended[0] == ("the Lighthouse", 137) and group0.signals == group1.signals == []
    assert capsys.readouterr().err.count("torchft's Lighthouse ended (exit 137): no step can be agreed") == 1
    assert group_launches.run_exit_code(None, ended) == EXIT_PREEMPTED
    assert group_launches.run_exit_code(None, [*ended[:2], ("group 1", 1)]) == 1  # a group's failure stays its own


def test_distrib_train_passes_the_groups_of_its_config_to_the_launcher(no_launch_env, monkeypatch, tmp_path):
    from distrib.config import load_config
    from distrib.distributed.dimensions import launch_flags

    config = load_config(None, ["dist.fault_tolerant_groups=2", "dist.min_replicas=2", f"run.dir={tmp_path}"])
    assert launch_flags(config, os.environ) == ["--replica-groups", "2", "--min-replicas", "2", "--lighthouse-log",
                                                str(tmp_path / "lighthouse.log")]
    assert launch_flags(load_config(None, []), os.environ) == []
    monkeypatch.setenv("RANK", "0")  # a worker of the groups launches nothing
    assert launch_flags(config, os.environ) == []


def test_distrib_train_checks_the_groups_before_any_worker_starts(no_launch_env, tmp_path, capsys):
    code = cli.main(["train", "--nproc-per-node", "3", "--set", "dist.fault_tolerant_groups=2",
                     "--set", f"run.dir={tmp_path}/run", "--set", "data.name=synthetic"])
    assert code == 2
    assert capsys.readouterr().err.strip().startswith("distrib: error: dist.fault_tolerant_groups = 2 "
                                                      "(--replica-groups 2) does not divide the 3 workers")


def test_the_lighthouse_address_names_this_machine_when_bound_to_every_interface():
    assert lighthouse.address("127.0.0.1:0", "http://vm:4711") == "http://127.0.0.1:4711"
    assert lighthouse.address("[::]:29510", "http://vm:29510") == f"http://{lighthouse.socket.gethostname()}:29510"
