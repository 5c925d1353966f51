"""Fault-tolerant replica groups, in process: the config's keys and refusals, the launch environment, each group's
folders, the data rank as a function of (group, rank in group), and ReplicaGroups against a stand-in for torchft's
Manager (the start barrier, the average over the groups that took part, a heal's state and its held quorum)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from distrib.config import DistConfig, TrainConfig
from distrib.data import make_plan
from distrib.distributed import fault_tolerance, group_folders
from distrib.distributed.fault_tolerance import (
    FinishedPeers,
    QuorumLost,
    ReplicaGroups,
    group_config,
    peer_config,
)
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime, read_launch_env
from distrib.distributed.strategies import check_config, parallel_dims
from distrib.errors import ConfigError, UserError
from distrib.training.state import new_state
from tests.helpers.support import small_config

CPU = torch.device("cpu")


def runtime(rank: int = 0, world_size: int = 1, group: int = 0) -> Runtime:
    return Runtime(rank, rank, world_size, world_size, CPU, "gloo", replica_group=group)


def test_keys_are_checked_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"dist.min_replicas = 3: more than the dist.fault_tolerant_groups = 2"):
        check_config(small_config(tmp_path, "dist.fault_tolerant_groups=2", "dist.min_replicas=3"))
    with pytest.raises(ConfigError, match=r"dist.fault_tolerant_groups = 0"):
        DistConfig(fault_tolerant_groups=0)
    with pytest.raises(ConfigError, match=r"dist.fault_tolerant_timeout_s"):
        DistConfig(fault_tolerant_timeout_s=0)


@pytest.mark.parametrize("key", ["pipeline_parallel", "tensor_parallel", "expert_parallel"])
def test_degrees_a_group_cannot_hold_are_refused(tmp_path, key):
    config = small_config(tmp_path, "dist.strategy=fsdp", "dist.fault_tolerant_groups=2", f"dist.{key}=2")
    with pytest.raises(ConfigError, match=rf"dist.{key} = 2: not inside fault-tolerant replica groups"):
        check_config(config)


def test_the_launch_environment_names_the_group_and_the_lighthouse():
    env = read_launch_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5",
                           "DISTRIB_REPLICA_GROUP": "2", "TORCHFT_LIGHTHOUSE": "http://h:29510"})
    assert (env.replica_group, env.lighthouse) == (2, "http://h:29510")
    assert read_launch_env({}).replica_group == 0
    with pytest.raises(UserError, match="DISTRIB_REPLICA_GROUP=-1"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "5",
                         "DISTRIB_REPLICA_GROUP": "-1"})


def test_each_group_but_the_first_writes_a_folder_of_its_own(tmp_path):
    config = small_config(tmp_path / "run", "dist.fault_tolerant_groups=3", f"checkpoint.dir={tmp_path / 'ckpt'}")
    assert group_config(config, 0) is config
    second = group_config(config, 2)
    assert Path(second.run.dir) == tmp_path / "run" / "replica_group_2"
    assert Path(second.checkpoint.dir) == tmp_path / "ckpt" / "replica_group_2"
    for group in range(3):  # and each group finds the folders of the others
        for peer in range(3):
            mine, theirs = group_config(config, group), group_config(config, peer)
            assert (peer_config(mine, group, peer).run.dir, peer_config(mine, group, peer).checkpoint.dir) == (
                theirs.run.dir, theirs.checkpoint.dir)


def test_a_group_reads_the_samples_of_its_ranks_in_one_world(tmp_path):
    """Three groups of one rank read what the three ranks of one world read; two groups of fsdp 2 what four ranks
    read, group by group."""
    train = TrainConfig(global_batch_size=24, max_steps=2)
    whole = [make_plan(240, train, runtime(rank, 3), ParallelDims.replicas(3)) for rank in range(3)]
    dims = parallel_dims(DistConfig(fault_tolerant_groups=3), 1, 1)
    groups = [make_plan(240, train, runtime(0, 1, group), dims) for group in range(3)]
    order = whole[0].order(0)
    for plan, reference in zip(groups, whole):
        assert all(torch.equal(a, b) for a, b in zip(plan.micro_batches(order, 1), reference.micro_batches(order, 1)))
    fsdp = parallel_dims(DistConfig(strategy="fsdp", fault_tolerant_groups=2), 2, 2)
    assert [fsdp.batch_rank(rank, group) for group in range(2) for rank in range(2)] == [0, 1, 2, 3]
    assert fsdp.batch_ranks == 4 and fsdp.world_size == 2


class FakeManager:
    """torchft's Manager as ReplicaGroups uses it: quorums whose sizes are given, an all-reduce whose peers hold the
    same tensor, a commit that says yes, and a heal that loads a given state."""

    def __init__(self, sizes: list[int], heal_with: dict | None = None):
        self.sizes, self.heal_with, self.quorums, self.load = list(sizes), heal_with, 0, None

    def start_quorum(self) -> None:
        self.quorums += 1
        self.size = self.sizes.pop(0) if self.sizes else self.size
        if self.heal_with is not None:
            self.load(self.heal_with)
            self.heal_with = None

    def num_participants(self) -> int:
        return self.size

    def allreduce(self, tensor, reduce_op):
        tensor *= self.size  # every group holds the same numbers
        return SimpleNamespace(wait=lambda: True)


def replicas(manager: FakeManager, state, groups: int = 3) -> ReplicaGroups:
    recorder = SimpleNamespace(write=lambda record: None, info=lambda line: None)
    groups_ = ReplicaGroups(manager, groups, 0, state, 24, runtime(), recorder, timeout_s=30)
    manager.load = groups_.load_state_dict
    return groups_


def small_state(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return new_state(model, TrainConfig(optimizer="adamw", lr=0.1, max_steps=4), 4, CPU)


def test_the_first_step_waits_for_every_group_and_the_gradients_are_averaged_once():
    state = small_state(0)
    manager = FakeManager([1, 2, 3, 2])
    groups = replicas(manager, state)
    assert not groups.start_step() and manager.quorums == 3 and groups.participants == 3  # the start barrier
    assert not groups.start_step() and manager.quorums == 4 and groups.participants == 2  # later: as many as came
    for param in state.model.parameters():
        param.grad = torch.full_like(param, 0.5)
    loss = groups.average(state.model, torch.tensor(2.0))
    assert loss.item() == 2.0 and all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in state.model.parameters())


def test_a_heal_loads_the_live_group_s_state_and_holds_its_quorum_for_the_next_step():
    source, healing = small_state(0), small_state(1)
    source.model(torch.ones(4, 3)).sum().backward()
    source.optimizer.step()
    source.scheduler.step()
    source.progress.step, source.progress.step_in_epoch = 5, 5
    sent = replicas(FakeManager([3]), source).state_dict()
    manager = FakeManager([3], heal_with=sent)
    groups = replicas(manager, healing)
    assert groups.start_step() and healing.progress.step == 5  # healed: the caller reads on from step 5
    assert not groups.start_step() and manager.quorums == 1  # the heal's quorum holds for that step
    for name, tensor in source.model.state_dict().items():
        assert torch.equal(tensor, healing.model.state_dict()[name])
    moments = [state.optimizer.state_dict()["state"][0]["exp_avg"] for state in (source, healing)]
    assert torch.equal(*moments)
    assert healing.scheduler.state_dict() == source.scheduler.state_dict()


def test_a_group_back_in_a_finished_run_takes_the_final_state_of_the_group_that_finished(tmp_path, monkeypatch):
    """Group 0 waits at the start barrier alone (its peer has ended); once group 1's summary.json says every step
    is done, it takes group 1's newest checkpoint, and the caller's loop ends there. The barrier asks the Lighthouse
    at BARRIER_POLL_S, not in a spin."""
    sleeps = []
    monkeypatch.setattr(fault_tolerance.time, "sleep", sleeps.append)
    config = small_config(tmp_path / "run", "dist.fault_tolerant_groups=2")
    source, behind = small_state(0), small_state(1)
    source.progress.step = 4
    summary = Path(group_config(config, 1).run.dir) / "summary.json"

    def find_after_two_polls():
        if len(sleeps) == 2:
            summary.parent.mkdir(parents=True)
            summary.write_text('{"steps": 4}')
        return FinishedPeers.find(finished)

    loaded = []
    checkpointer = SimpleNamespace(load=lambda resume, say: {**source.state_dict(24), "world_size": 1,
                                                              "rng": [runtime().rng_state()]})
    finished = FinishedPeers(config, 0, 4, lambda peer: loaded.append(peer.run.dir) or checkpointer)
    groups = replicas(FakeManager([1]), behind, groups=2)
    groups.finished = SimpleNamespace(find=find_after_two_polls, take=finished.take)
    assert groups.start_step() and behind.progress.step == 4 and loaded == [group_config(config, 1).run.dir]
    assert sleeps == [fault_tolerance.BARRIER_POLL_S] * 2
    assert all(torch.equal(tensor, behind.model.state_dict()[name])
               for name, tensor in source.model.state_dict().items())


def test_a_quorum_that_times_out_without_a_lighthouse_is_a_stop_not_a_crash():
    class Lost(FakeManager):
        def start_quorum(self):
            raise TimeoutError("status: Cancelled, message: Timeout expired")

    groups = replicas(Lost([2]), small_state(0), groups=2)
    groups.runtime = Runtime(0, 0, 1, 1, CPU, "gloo", lighthouse="http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(QuorumLost, match="no quorum within dist.timeout_s = 30 s .* does not answer"):
        groups.start_step()


def test_steps_the_groups_never_commit_stop_the_group_after_a_few_tries():
    """torchft's collectives broken for good (say, a Lighthouse started again reuses a quorum id): the group stops
    with QuorumLost (the trainer checkpoints and exits 75) instead of retrying the step for ever."""
    class NeverCommits(FakeManager):
        def should_commit(self):
            return False

    groups = replicas(NeverCommits([3]), small_state(0))
    for _ in range(fault_tolerance.MAX_UNCOMMITTED):
        assert not groups.start_step() and not groups.commit()
    with pytest.raises(QuorumLost, match=f"committed none of {fault_tolerance.MAX_UNCOMMITTED} tries of step 1"):
        groups.start_step()


def _finished_peers(tmp_path, total_steps: int = 4) -> FinishedPeers:
    config = small_config(tmp_path / "run", "dist.fault_tolerant_groups=2")
    return FinishedPeers(config, 0, total_steps, lambda peer: None)


def _write(config, group: int, name: str, record: dict) -> None:
    path = Path(group_config(config, group).run.dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def test_a_run_that_stopped_early_is_finished_by_what_its_summary_says_not_by_its_step_count(tmp_path):
    """Group 1 stopped early at step 2 of 4 (its summary's stop_reason, as the trainer writes it): group 0 takes it as
    finished. A summary of fewer steps that completed (a run since extended) is not finished; nor is a torn one."""
    finished = _finished_peers(tmp_path)
    assert finished.find() is None
    _write(finished.config, 1, "summary.json", {"steps": 2, "stop_reason": "completed"})
    assert finished.find() is None
    (Path(group_config(finished.config, 1).run.dir) / "summary.json").write_text('{"steps": 2, "stop_re')
    assert finished.find() is None
    _write(finished.config, 1, "summary.json", {"steps": 2, "stop_reason": "early_stop"})
    assert finished.find() == 1
    _write(finished.config, 1, "summary.json", {"steps": 4, "stop_reason": "completed"})
    assert finished.find() == 1


def test_the_trainer_s_early_stop_reason_is_the_one_a_finished_run_is_read_by():
    from distrib.training.trainer import Trainer

    stopped = SimpleNamespace(stopped_early=lambda: True,
                              state=SimpleNamespace(early_stop=SimpleNamespace(reason=lambda: "no improvement")))
    assert Trainer.stop_reason(stopped)["stop_reason"] == group_folders.EARLY_STOP


def test_a_group_waits_past_the_timeout_for_a_peer_whose_training_ended_and_that_evaluates(tmp_path, monkeypatch):
    """dist.timeout_s = 30 s on a fake clock: group 1's training loop ended at the last step (its TRAINING_ENDED,
    written by its ReplicaGroups.training_ended) and its final evaluation runs for 100 s. Group 0, alone at the
    start barrier, does not give up at 30 s: it waits, says so once, and takes group 1's final state once its
    summary.json appears. Without the marker the same wait is the one-line timeout."""
    clock = [0.0]
    lines = []
    source, behind = small_state(0), small_state(1)
    source.progress.step = 4
    finished = _finished_peers(tmp_path)
    config = finished.config
    peer = FinishedPeers(group_config(config, 1), 1, 4, lambda peer: None)

    def tick(seconds):
        clock[0] += seconds
        if clock[0] >= 100:
            _write(config, 1, "summary.json", {"steps": 4, "stop_reason": "completed"})

    monkeypatch.setattr(fault_tolerance.time, "sleep", tick)
    monkeypatch.setattr(fault_tolerance.time, "monotonic", lambda: clock[0])
    checkpointer = SimpleNamespace(load=lambda resume, say: {**source.state_dict(24), "world_size": 1,
                                                              "rng": [runtime().rng_state()]})
    waiting = FinishedPeers(config, 0, 4, lambda peer: checkpointer)
    groups = replicas(FakeManager([1]), behind, groups=2)
    groups.finished, groups.recorder = waiting, SimpleNamespace(write=lambda record: None, info=lines.append)
    with pytest.raises(UserError, match=r"^only 1 of dist.fault_tolerant_groups = 2 replica groups joined within "
                                        r"dist.timeout_s = 30 s"):
        groups.start_step()
    assert 30 <= clock[0] < 31  # no marker: the timeout, as before

    clock[0] = 0.0
    peer_groups = replicas(FakeManager([2]), source, groups=2)
    peer_groups.finished = peer
    Path(peer.config.run.dir).mkdir(parents=True)
    peer_groups.training_ended(4, "completed")  # group 1's trainer, before its final evaluation
    assert json.loads((Path(group_config(config, 1).run.dir) / group_folders.TRAINING_ENDED).read_text()) == {
        "steps": 4, "stop_reason": "completed"}
    groups = replicas(FakeManager([1]), behind, groups=2)
    groups.finished, groups.recorder = waiting, SimpleNamespace(write=lambda record: None, info=lines.append)
    assert groups.start_step() and clock[0] >= 100 and behind.progress.step == 4
    assert [line for line in lines if "training ended" in line] == [
        "replica group 0: group 1's training ended; waiting for its final evaluation and summary.json to take its "
        "final state"]
