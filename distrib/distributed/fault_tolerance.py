"""The fault-tolerant replicate degree's worker side (dist.fault_tolerant_groups = G, declared in
distrib.distributed.dimensions.replica_groups): G replica groups, each its own world with its own rendezvous and
restarts, kept in step by torchft: a quorum per step, one all-reduce of the gradients across the groups that took
part, a commit, and a restarted group healed from a live one's state (docs/fault_tolerance.md). torchft's Manager is
made in torchft_manager; the state a heal sends and takes is replica_heal's."""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Iterator
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.distributed.across import AgreementLost
from distrib.distributed.group_folders import FinishedPeers, group_config, peer_config
from distrib.distributed.parallel import local_tensor
from distrib.distributed.replica_heal import sent_state, take_state
from distrib.distributed.runtime import LIGHTHOUSE_VAR, REPLICA_GROUP_VAR, Runtime
from distrib.distributed.torchft_manager import make_manager
from distrib.errors import UserError

# group_config and peer_config: each group's folders, which the declaration takes from here.
__all__ = ["FinishedPeers", "QuorumLost", "ReplicaGroups", "group_config", "peer_config", "replica_groups"]

# How often a group that waits at the start barrier asks for a quorum again: each ask is a request to the Lighthouse
# (and a line of its log); without a pause a waiting group asked ~1,100 times a second.
BARRIER_POLL_S = 0.5


# Tries of one step in a row that the groups did not commit, after which this group stops (QuorumLost). A lost group
# costs the others one try; more means the groups' collectives are broken (e.g. a Lighthouse started again counts
# quorum ids from 1, and torchft does not rebuild them for an id it has seen).
MAX_UNCOMMITTED = 5


class QuorumLost(AgreementLost):
    """The step's quorum timed out or failed with the Lighthouse gone, or the groups committed none of
    MAX_UNCOMMITTED tries: this group can agree on no step with the others any more. The trainer checkpoints and stops
    with the preemption code (its launcher's restart, or a rerun, resumes there and joins afresh)."""


def lighthouse_answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether something listens at the Lighthouse's address (a TCP connect)."""
    address = urlsplit(url if "://" in url else f"http://{url}")
    try:
        with socket.create_connection((address.hostname, address.port or 29510), timeout=timeout_s):
            return True
    except OSError:
        return False


def _check_launch(groups: int, runtime: Runtime) -> None:
    """A one-line UserError for a worker that is not launched as a replica group."""
    if not runtime.lighthouse or not runtime.store:
        raise UserError(f"dist.fault_tolerant_groups = {groups}: each replica group is a world of its own, launched "
                        f"by distrib launch or torchrun with {LIGHTHOUSE_VAR} (the torchft Lighthouse's "
                        f"http://host:port) and {REPLICA_GROUP_VAR} (0 to {groups - 1}) set; launch with distrib "
                        "train (which starts them on one node) or see docs/fault_tolerance.md")
    if runtime.replica_group >= groups:
        raise UserError(f"{REPLICA_GROUP_VAR}={runtime.replica_group}: dist.fault_tolerant_groups = {groups} has "
                        f"groups 0 to {groups - 1}; fix the job script, or raise dist.fault_tolerant_groups")


class ReplicaGroups:
    """This group's seat in the groups' quorum (torchft's Manager): the trainer's collaborator for the start of each
    step (the quorum, and a heal from a live group), the all-reduce of the gradients across the groups, and the
    commit. Every rank of the group makes the same calls; torchft pairs rank r of each group."""

    def __init__(self, manager, groups: int, group: int, state, global_batch_size: int, runtime: Runtime,
                 recorder, timeout_s: float, finished: FinishedPeers | None = None):
        self.manager, self.groups, self.group = manager, groups, group
        self.state, self.global_batch_size, self.runtime = state, global_batch_size, runtime
        self.recorder, self.timeout_s, self.finished = recorder, timeout_s, finished
        self.participants = 0  # groups in this step's quorum
        self._starting = True  # the job's first step waits for every group
        self._healed_from: int | None = None
        self._held = False  # a heal's quorum, held for the step the healed state takes next
        self._uncommitted = 0  # tries in a row that the groups did not commit

    def start_step(self) -> bool:
        """The step's quorum (the job's first: every group, a start barrier); True when it healed this group: the
        state is then a live group's, at its progress, and that quorum holds for the step read from there (the other
        groups are in it already), or when this group took the final state of a group that finished the run (see
        FinishedPeers)."""
        if self._held:
            self._held = False
            return False
        if self._uncommitted >= MAX_UNCOMMITTED:
            raise QuorumLost(f"replica group {self.group}: the groups committed none of {self._uncommitted} tries of "
                             f"step {self.state.progress.step + 1}: this group checkpoints and stops (exit 75); its "
                             "launcher restarts it from there (--max-restarts), or run the same command again")
        self._healed_from, started = None, time.perf_counter()
        self._quorum()
        deadline = time.monotonic() + self.timeout_s
        while self._starting and self._healed_from is None and self.manager.num_participants() < self.groups:
            peer, expired = self._barrier_verdict(deadline)
            if peer is not None:
                return self._take_finished(peer, started)
            if expired:
                raise UserError(f"only {self.manager.num_participants()} of dist.fault_tolerant_groups = "
                                f"{self.groups} replica groups joined within dist.timeout_s = {self.timeout_s:g} s at "
                                "the start; start every group (each one's log says why it did not), or raise "
                                "dist.timeout_s")
            time.sleep(BARRIER_POLL_S)
            self._quorum()
        self._starting = False
        self._note(time.perf_counter() - started)
        self._held = self._healed_from is not None
        return self._held

    def _quorum(self) -> None:
        """torchft's quorum; QuorumLost when it timed out or the Lighthouse is gone: torchft's Manager cannot ask
        again after a failed quorum, and a Lighthouse started again does not answer a quorum asked of the old one."""
        try:
            self.manager.start_quorum()
        except Exception as e:
            if not isinstance(e, TimeoutError) and lighthouse_answers(self.runtime.lighthouse):
                raise
            answers = "was started again" if lighthouse_answers(self.runtime.lighthouse) else "does not answer"
            raise QuorumLost(f"replica group {self.group}: no quorum within dist.timeout_s = {self.timeout_s:g} s "
                                 f"(torchft's Lighthouse at {self.runtime.lighthouse} {answers}): this group "
                                 "checkpoints and stops (exit 75); its launcher restarts it from there "
                                 "(--max-restarts), or run the same command again") from None

    def _barrier_verdict(self, deadline: float) -> tuple[int | None, bool]:
        """Rank 0's, heard by every rank of this group (one broadcast, so they act alike): a group that finished the
        run while this one was down, and whether the start barrier's time is up (not while a group whose training
        ended evaluates: its summary.json is awaited)."""
        finished = self.finished if self.runtime.is_main else None
        peer = finished.find() if finished else None
        verdict = [peer, time.monotonic() > deadline and not (finished and finished.awaits(self.recorder.info))]
        if self.runtime.world_size > 1:
            dist.broadcast_object_list(verdict, src=0)
        return verdict[0], verdict[1]

    def _take_finished(self, peer: int, started: float) -> bool:
        """This group takes the final state of group `peer`, which finished the run: the caller's loop then ends, and
        the run ends as a finished one (its checkpoint, evaluation, weights and summary.json)."""
        self.finished.take(peer, self.state, self.runtime, self.global_batch_size, self.recorder.info)
        step = self.state.progress.step
        self.recorder.write({"step": step, "event": "took_finished_state", "from_group": peer,
                             "seconds": time.perf_counter() - started, "time": time.time()})
        self.recorder.info(f"replica group {self.group}: group {peer} finished the run ({step} steps) while this group "
                           "was down; took its final state")
        self._starting = False
        return True

    def _note(self, seconds: float) -> None:
        """The log and metrics.jsonl: a heal, and each change in the groups that take part."""
        step, count = self.state.progress.step, self.manager.num_participants()
        if self._healed_from is not None:
            self.recorder.write({"step": step, "event": "healed", "from_group": self._healed_from,
                                 "seconds": seconds, "time": time.time()})
            self.recorder.info(f"replica group {self.group} healed from group {self._healed_from} at step {step} in "
                               f"{seconds:.2f} s")
        if count != self.participants:
            self.recorder.write({"step": step + 1, "event": "replica_groups", "participants": count,
                                 "groups": self.groups, "time": time.time()})
            self.recorder.info(f"step {step + 1}: {count} of {self.groups} replica groups take part")
        self.participants = count

    def average(self, model: nn.Module, local_loss: torch.Tensor) -> torch.Tensor:
        """Each rank's gradients (its shards, under fsdp) summed over the groups in the quorum and divided by their
        count, once, in one flat buffer that carries this rank's loss too (returned, averaged alike). On a failure
        inside it torchft records the error and the commit says no."""
        from torch.distributed import ReduceOp

        grads = [local_tensor(param.grad) for param in model.parameters() if param.grad is not None]
        dtypes = {grad.dtype for grad in grads}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        flat = torch.cat([*(grad.reshape(-1).to(dtype) for grad in grads),
                          local_loss.detach().reshape(1).to(dtype)])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        flat /= self.participants
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        return flat[-1].to(local_loss.dtype)

    def commit(self) -> bool:
        """Whether every group rank's step went through with enough groups (dist.min_replicas): the update is taken
        only then; else the same samples again after a new quorum. The same answer on every rank of the group."""
        committed = self.manager.should_commit()
        self._uncommitted = 0 if committed else self._uncommitted + 1
        return committed

    @property
    def share(self) -> float:
        """The part of the global batch that this step's groups read."""
        return self.participants / self.groups

    def logged(self) -> dict:
        return {"replica_groups": self.participants}

    def training_ended(self, step: int, stop_reason: str) -> None:
        if self.runtime.is_main and self.finished is not None:
            self.finished.training_ended(step, stop_reason)

    def state_dict(self) -> dict:
        """What a healing group loads (distrib.distributed.replica_heal), called in torchft's quorum thread."""
        return sent_state(self.state, self.global_batch_size, self.runtime, self.group)

    def load_state_dict(self, received: dict) -> None:
        self._healed_from = take_state(self.state, self.global_batch_size, self.runtime, received)


@contextlib.contextmanager
def replica_groups(config, runtime: Runtime, state, plan, recorder,
                   finished: FinishedPeers | None = None) -> Iterator[ReplicaGroups | None]:
    """This group's ReplicaGroups for the training steps (None: dist.fault_tolerant_groups = 1), its torchft Manager
    shut down after them; finished: how it takes the final state of a group that finished the run."""
    groups = config.dist.fault_tolerant_groups
    if groups == 1:
        yield None
        return
    _check_launch(groups, runtime)
    if plan.num_samples is None:
        raise UserError(f"dist.fault_tolerant_groups = {groups}: the training data is a stream, whose position a "
                        "healed group cannot take from a live one yet; use map-style data, or --set "
                        "dist.fault_tolerant_groups=1")
    manager = make_manager(config, runtime)
    replicas = ReplicaGroups(manager, groups, runtime.replica_group, state, plan.global_batch_size, runtime, recorder,
                             config.dist.timeout_s, finished)
    manager.register_state_dict_fn("distrib", replicas.load_state_dict, replicas.state_dict)
    manager.load_state_dict({"step": state.progress.step, "batches_committed": 0})  # resumed: the checkpoint's step
    try:
        yield replicas
    finally:
        manager.shutdown(wait=False)

