"""Fault-tolerant replica groups. Three groups of one worker (dist.fault_tolerant_groups = 3): torchft's Lighthouse
in this process and one `distrib launch` per group with DISTRIB_REPLICA_GROUP and TORCHFT_LIGHTHOUSE set, as a
multi-node job script starts them, each restarted by its own launcher (--max-restarts 1): every group killed and
resumed from its checkpoint (against one process without fault tolerance), and one group killed inside a step, which
the others outlive and which heals from them. Two groups of fsdp 2 started by `distrib train --nproc-per-node 4`:
a rank killed inside the gradient all-reduce across the groups, its group healed shard by shard. Two groups of ddp 2:
a group lost while the other finishes takes its final state. The Lighthouse hung, then killed: the groups stop at a
checkpoint and resume with the one started again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import EVENT_S, Launches, clean_env, descendants, wait_for
from tests.helpers.support import SMALL, load_weights, max_relative_diff, sets

pytest.importorskip("torchft")

GROUPS = 3
# AdamW on the plain Network (no attention, so no key bias whose zero gradient AdamW would blow up from noise); the
# dying factory is the plain model unless DISTRIB_TEST_DIE_AT is set.
RUN = (*SMALL, "train.epochs=0", "train.log_every=1", "train.optimizer=adamw", "train.lr=0.01",
       "train.global_batch_size=24", "model.factory=tests.helpers.dying_model:network")
PACED = 'train.callbacks=["tests.helpers.ft_pace:PaceUntilFile"]'  # live groups step on while a killed one restarts


@contextlib.contextmanager
def lighthouse():
    from torchft.coordination import LighthouseServer

    # distrib's own Lighthouse settings (distrib.launch.lighthouse), a quorum tick of 10 ms
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=5000, quorum_tick_ms=10,
                              heartbeat_timeout_ms=5000)
    try:
        yield server.address()
    finally:
        server.shutdown()


def start_groups(launches: Launches, address: str, run_dir: Path, overrides: tuple, env_of) -> None:
    for group in range(GROUPS):
        env = clean_env(DISTRIB_REPLICA_GROUP=str(group), TORCHFT_LIGHTHOUSE=address, OMP_NUM_THREADS="1",
                        **env_of(group))
        launches.start([sys.executable, "-m", "distrib", "launch", "--nproc-per-node", "1", "--standalone",
                        "--max-restarts", "1", "-m", "distrib", "train",
                        *sets(*RUN, f"run.dir={run_dir}", f"dist.fault_tolerant_groups={GROUPS}", *overrides)], env)


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir if group == 0 else run_dir / f"replica_group_{group}"


def records(run_dir: Path, group: int) -> list[dict]:
    path = group_dir(run_dir, group) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summary(run_dir: Path, group: int) -> dict:
    return json.loads((group_dir(run_dir, group) / "summary.json").read_text())


def assert_groups_equal(run_dir: Path, groups: int = GROUPS) -> None:
    first = load_weights(group_dir(run_dir, 0))
    for group in range(1, groups):
        other = load_weights(group_dir(run_dir, group))
        assert all(torch.equal(first[name], other[name]) for name in first), f"group {group} differs from group 0"


def test_all_groups_killed_resume_bitwise_and_match_one_process(tmp_path):
    """Every group killed in step 8: each launcher restarts it, it resumes from its step-6 checkpoint, the start
    barrier waits for all three, and steps 7 and 8 are the same bits again; the end is within 1e-5 of one process
    without fault tolerance (torchft sums, then divides by the groups; DDP's order differs) and the same bits in
    every group."""
    run_dir, reference = tmp_path / "groups", tmp_path / "reference"
    overrides = ("train.max_steps=12", "checkpoint.every_steps=6")
    with lighthouse() as address, Launches(tmp_path) as launches:
        start_groups(launches, address, run_dir, overrides, lambda group: dict(
            DISTRIB_TEST_DIE_AT="8", DISTRIB_TEST_DIE_RANK="0", DISTRIB_TEST_DIE_ONCE=str(tmp_path / f"died_{group}")))
        launches.start([sys.executable, "-m", "distrib", "train", *sets(*RUN, f"run.dir={reference}", *overrides)],
                       clean_env(OMP_NUM_THREADS="1"))
        done = launches.wait(EVENT_S)
    assert all(result.returncode == 0 for result in done), "\n".join(result.text() for result in done)
    for group in range(GROUPS):
        assert (tmp_path / f"died_{group}").exists() and summary(run_dir, group)["resumed_from_step"] == 6
        lines = records(run_dir, group)
        resume = next(index for index, record in enumerate(lines) if record.get("event") == "resume")
        before = {r["step"]: r["loss"] for r in lines[:resume] if "loss" in r and r["step"] > 6}
        after = {r["step"]: r["loss"] for r in lines[resume:] if "loss" in r and r["step"] in before}
        assert before and before == after, (group, before, after)  # the resumed steps, the same bits
        assert all(r["replica_groups"] == GROUPS for r in lines if "loss" in r)
    assert_groups_equal(run_dir)
    assert max_relative_diff(load_weights(run_dir), load_weights(reference)) < 1e-5


def paced(healed: Path, revive: Path, hold_at: int) -> dict[str, str]:
    """tests.helpers.ft_pace's variables: 0.2 s steps until the heal; the live groups wait at step hold_at until the
    restarted group's rank 0 is up (dying_model touches revive.0), then have 60 paced steps (12 s) to heal it in."""
    return dict(DISTRIB_TEST_PACE_UNTIL=str(healed), DISTRIB_TEST_PACE_S="0.2", DISTRIB_TEST_PACE_HOLD_AT=str(hold_at),
                DISTRIB_TEST_PACE_HOLD_FOR=f"{revive}.0")


def alone_then_healed(run_dir: Path, groups: int, dying: int, revive: Path, healed: Path, procs) -> dict:
    """Waits until the groups other than `dying` have logged two steps without it, lets the dying group's restarted
    workers go on (revive), waits for its heal, and ends the pacing (healed); returns the heal's record."""
    def stepped_alone() -> bool:
        return sum(r.get("replica_groups") == groups - 1 for r in records(run_dir, 0) if "loss" in r) >= 2

    wait_for(stepped_alone, EVENT_S, "two steps of the live groups without the killed one", procs)
    revive.touch()
    heal = wait_for(lambda: next((r for r in records(run_dir, dying) if r.get("event") == "healed"), None),
                    EVENT_S, f"heal of group {dying}", procs)
    healed.touch()  # the groups run to the end at full speed
    return heal


def assert_outlived(run_dir: Path, groups: int, dying: int, heal: dict, died_at: int, max_steps: int) -> None:
    """The live groups never restarted, stepped through the loss of `dying` within 10 s, counted every step once,
    took the steps between with one group less; the healed group came from a live one; all end with the same bits."""
    assert heal["from_group"] != dying and summary(run_dir, dying)["restart_count"] == 1
    for group in set(range(groups)) - {dying}:
        lines = records(run_dir, group)
        assert summary(run_dir, group)["restart_count"] == 0 and not any(r.get("event") == "resume" for r in lines)
        counts = [r["participants"] for r in lines if r.get("event") == "replica_groups"]
        assert counts == [groups, groups - 1, groups], counts
        steps = {r["step"]: r for r in lines if "loss" in r}
        assert sorted(steps) == list(range(1, max_steps + 1))  # none skipped, none twice
        stall = steps[died_at]["step_time_p50_s"]  # the step whose all-reduce lost the group, retried without it
        assert stall < 10, stall
        print(f"group {group}: step {died_at} took {stall:.2f} s; group {dying} healed in {heal['seconds']:.2f} s")
    assert_groups_equal(run_dir, groups)


def test_group_killed_in_a_step_heals_while_the_others_go_on(tmp_path):
    """Group 2 kills itself inside step 10 (after the step's quorum, while the others are in the gradient all-reduce
    that loses it): groups 0 and 1 retry that step without it within 10 s, go on as two, and never restart; group 2's
    launcher restarts it, it heals from a live group and ends with the same bits as both."""
    run_dir, revive, healed = tmp_path / "groups", tmp_path / "revive", tmp_path / "healed"
    dying = dict(DISTRIB_TEST_DIE_AT="10", DISTRIB_TEST_DIE_RANK="0", DISTRIB_TEST_DIE_ONCE=str(tmp_path / "died"),
                 DISTRIB_TEST_REVIVE_WHEN=str(revive))
    overrides = ("train.max_steps=73", "dist.fault_tolerant_timeout_s=5", PACED)
    with lighthouse() as address, Launches(tmp_path) as launches:
        start_groups(launches, address, run_dir, overrides, lambda group: dict(
            **paced(healed, revive, hold_at=13), **(dying if group == 2 else {})))
        heal = alone_then_healed(run_dir, GROUPS, 2, revive, healed, [proc for proc, _, _ in launches.procs])
        done = launches.wait(EVENT_S)
    assert all(result.returncode == 0 for result in done), "\n".join(result.text() for result in done)
    assert_outlived(run_dir, GROUPS, 2, heal, 10, 73)


def test_two_groups_of_fsdp_started_by_distrib_train_heal_a_killed_rank(tmp_path):
    """`distrib train --nproc-per-node 4` with dist.fault_tolerant_groups = 2 under fsdp: the launcher starts the
    Lighthouse and two groups of fsdp 2; rank 1 of group 1 is SIGKILLed inside step 6's gradient all-reduce across
    the groups (once it has issued it; its peer, rank 1 of group 0, is inside it), its launcher restarts the group,
    which heals (each rank the shards of its peer rank in group 0) while group 0 goes on alone."""
    run_dir, revive, healed = tmp_path / "groups", tmp_path / "revive", tmp_path / "healed"
    env = clean_env(DISTRIB_TEST_DIE_AT="6", DISTRIB_TEST_DIE_IN="allreduce", DISTRIB_TEST_DIE_RANK="1",
                    DISTRIB_TEST_DIE_GROUP="1",
                    DISTRIB_TEST_DIE_ONCE=str(tmp_path / "died"), DISTRIB_TEST_REVIVE_WHEN=str(revive),
                    **paced(healed, revive, hold_at=9))
    with Launches(tmp_path) as launches:
        launches.start([sys.executable, "-m", "distrib", "train", "--nproc-per-node", "4", "--max-restarts", "1",
                        *sets(*RUN, f"run.dir={run_dir}", "dist.strategy=fsdp", "dist.fault_tolerant_groups=2",
                              "dist.fault_tolerant_timeout_s=5", "train.max_steps=69", PACED)], env)
        heal = alone_then_healed(run_dir, 2, 1, revive, healed, [proc for proc, _, _ in launches.procs])
        done = launches.wait(EVENT_S)
    assert all(result.returncode == 0 for result in done), "\n".join(result.text() for result in done)
    assert "Traceback" not in done[0].stderr, done[0].stderr  # the lost group is a line, not a traceback
    assert_outlived(run_dir, 2, 1, heal, 6, 69)


def lighthouse_of(launcher_pid: int) -> int | None:
    """The pid of the `distrib lighthouse` that the launcher started, if it runs."""
    for pid in descendants(launcher_pid):
        with contextlib.suppress(OSError):
            if b"lighthouse\x00--bind" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def test_a_group_lost_while_the_other_finishes_takes_its_final_state(tmp_path):
    """Two groups of ddp 2: rank 1 of group 0 SIGKILLed late (step 8 of 12, after its step-5 checkpoint) and, in a
    second run, early (step 2, before any checkpoint); its restart is held back until group 1 has finished (its
    summary.json exists), as a node that reboots. Group 0 comes back to a finished run: it takes group 1's final
    state, and run.dir holds model.pt and summary.json, the same bits as group 1's; the run ends 0."""
    runs = {died_at: tmp_path / f"killed_at_{died_at}" for died_at in (8, 2)}
    with Launches(tmp_path) as launches:
        for died_at, run_dir in runs.items():
            env = clean_env(DISTRIB_TEST_DIE_AT=str(died_at), DISTRIB_TEST_DIE_RANK="1", DISTRIB_TEST_DIE_GROUP="0",
                            DISTRIB_TEST_DIE_ONCE=str(tmp_path / f"died_{died_at}"),
                            DISTRIB_TEST_REVIVE_WHEN=str(run_dir / "replica_group_1" / "summary.json"))
            launches.start([sys.executable, "-m", "distrib", "train", "--nproc-per-node", "4", "--max-restarts", "1",
                            *sets(*RUN, f"run.dir={run_dir}", "dist.fault_tolerant_groups=2", "train.max_steps=12",
                                  "checkpoint.every_steps=5")], env)
        done = launches.wait(EVENT_S)
    assert all(result.returncode == 0 for result in done), "\n".join(result.text() for result in done)
    for died_at, run_dir in runs.items():
        assert (tmp_path / f"died_{died_at}").exists() and (run_dir / "model.pt").exists()
        assert summary(run_dir, 0)["steps"] == summary(run_dir, 1)["steps"] == 12
        took = [r for r in records(run_dir, 0) if r.get("event") == "took_finished_state"]
        assert [r["from_group"] for r in took] == [1] and summary(run_dir, 1)["restart_count"] == 0
        ended = json.loads((group_dir(run_dir, 1) / "training_ended.json").read_text())  # before its evaluation
        assert ended == {"steps": 12, "stop_reason": "completed"}
        assert max_relative_diff(load_weights(run_dir), load_weights(group_dir(run_dir, 1))) < 1e-5
        assert_groups_equal(run_dir, 2)  # the same bits


def test_a_lighthouse_lost_stops_the_groups_at_a_checkpoint_and_one_started_again_resumes_them(tmp_path):
    """The Lighthouse that `distrib train` started hangs at step 5 of two groups of one (SIGSTOP): each group's quorum
    gives up (dist.timeout_s), the group checkpoints at the step it stopped at (the run takes no periodic ones) and
    ends 75. Then it is SIGKILLed: the launcher starts it again at its address, each group's launcher restarts its
    group from that checkpoint, and the run ends 0, every step once, the groups the same bits. Every group's line is
    prefixed by its group, and no log of the run (the Lighthouse's is in run.dir) grows past 10 MB."""
    run_dir = tmp_path / "groups"
    env = clean_env(DISTRIB_TEST_PACE_UNTIL=str(tmp_path / "never"), DISTRIB_TEST_PACE_S="0.2")
    checkpoints = [group_dir(run_dir, group) / "checkpoints" for group in range(2)]
    with Launches(tmp_path) as launches:
        launches.start([sys.executable, "-m", "distrib", "train", "--nproc-per-node", "2", "--max-restarts", "1",
                        *sets(*RUN, f"run.dir={run_dir}", "dist.fault_tolerant_groups=2", "train.max_steps=16",
                              "dist.timeout_s=15", PACED)], env)
        procs = [proc for proc, _, _ in launches.procs]
        wait_for(lambda: sum("loss" in r for r in records(run_dir, 0)) >= 5, EVENT_S, "step 5", procs)
        pid = wait_for(lambda: lighthouse_of(procs[0].pid), EVENT_S, "the Lighthouse", procs)
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all(any(folder.glob("step_*.pt")) for folder in checkpoints), EVENT_S,
                 "each group's checkpoint at the stop", procs)
        os.kill(pid, signal.SIGKILL)
        done = launches.wait(EVENT_S)
    assert done[0].returncode == 0, done[0].text()
    stderr = done[0].stderr
    assert "started it again at the same address (1 of 3)" in stderr
    for group in range(2):
        stopped = next(r for r in records(run_dir, group) if r.get("event") == "resume")["step"]  # no periodic ones
        assert stopped >= 5 and summary(run_dir, group)["resumed_from_step"] == stopped
        assert sorted({r["step"] for r in records(run_dir, group) if "loss" in r}) == list(range(1, 17))
        assert f"[group {group}] [distrib] replica group {group}: no quorum within dist.timeout_s = 15 s" in stderr
    assert not [line for line in stderr.splitlines() if line.startswith("[distrib]")]  # every group line prefixed
    assert (run_dir / "lighthouse.log").read_text().count("distrib lighthouse: listening at") == 2  # started again
    assert max(path.stat().st_size for path in tmp_path.rglob("*") if path.is_file()) < 10 * 2**20
    assert_groups_equal(run_dir, 2)
