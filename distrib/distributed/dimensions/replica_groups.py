"""Fault-tolerant replica groups' declaration (dist.fault_tolerant_groups, dist.min_replicas,
dist.fault_tolerant_timeout_s): the job's ranks split into G worlds of their own, each with its own mesh, rendezvous
and restarts, kept in step by torchft. It adds no mesh dimension: it divides the job's world (the plan's) by G,
multiplies the micro-batch streams (ParallelDims.batch_ranks), and adds one all-reduce across the groups of each
rank's gradients (its shards under fsdp, the whole under ddp). Its launcher's flags, each group's config and the
worker's hook around the training steps come from here; the mechanisms are distrib.launch.replica_groups and
group_launches (the launcher's side) and distrib.distributed.fault_tolerance (the worker's)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Mapping

from distrib.config import Config, DistConfig
from distrib.distributed import fault_tolerance
from distrib.distributed.dimensions.base import Dimension, StepCost, Traffic, Training, Words, group_split
from distrib.distributed.mesh import ParallelDims, divisors, either
from distrib.distributed.runtime import LaunchEnv
from distrib.errors import ConfigError
from distrib.launch.clusters import is_worker

GROUPS = "groups"  # its place in the layout's words (no mesh dimension of torch's)
# The degrees a replica group cannot hold yet: each rank's local gradient would all-reduce alike across the groups,
# but the heal of their state and the pipeline's schedule are not built.
_NOT_INSIDE = ("pipeline_parallel", "tensor_parallel", "expert_parallel")


class ReplicaGroups(Dimension):
    name = "replica groups"
    keys = ("fault_tolerant_groups", "min_replicas", "fault_tolerant_timeout_s")
    names_layout = True  # the strategy's name does not say that the job's ranks are G worlds
    traffic_name = "all-reduce across replica groups"

    def on(self, dims: ParallelDims) -> bool:
        return dims.fault_tolerant_groups > 1

    def check(self, config: Config) -> None:
        """What a fault-tolerant replica group cannot hold (or torchft missing), before any worker starts."""
        dist = config.dist
        groups = dist.fault_tolerant_groups
        if dist.min_replicas > groups:
            raise ConfigError(f"dist.min_replicas = {dist.min_replicas}: more than the dist.fault_tolerant_groups = "
                              f"{groups} groups, so no step could commit; set it to {groups} or fewer")
        if groups == 1:
            return
        for name in _NOT_INSIDE:
            value = getattr(dist, name)
            if value > 1:
                raise ConfigError(f"dist.{name} = {value}: not inside fault-tolerant replica groups "
                                  f"(dist.fault_tolerant_groups = {groups}) yet: ddp, fsdp or hsdp only; set --set "
                                  f"dist.{name}=1 or --set dist.fault_tolerant_groups=1")
        if importlib.util.find_spec("torchft") is None:
            raise ConfigError(f"dist.fault_tolerant_groups = {groups}: needs torchft, which is not installed; "
                              "pip install 'distrib[ft]' (or torchft), or --set dist.fault_tolerant_groups=1")

    def worlds(self, config: DistConfig, world_size: int, local_world_size: int) -> int:
        """G: each group a world of world_size / G ranks, on whole nodes or within one (as distrib launch starts
        them)."""
        groups = config.fault_tolerant_groups
        if world_size % groups:
            raise ConfigError(f"dist.fault_tolerant_groups = {groups}: does not divide world size {world_size}; use "
                              f"{either(divisors(world_size))} (the divisors of {world_size}), or a world size that "
                              f"is a multiple of {groups}")
        ranks = world_size // groups
        if ranks % local_world_size and local_world_size % ranks:
            raise ConfigError(f"dist.fault_tolerant_groups = {groups}: groups of {ranks} ranks straddle nodes of "
                              f"{local_world_size}; use a number of groups whose ranks fill whole nodes or divide "
                              "one")
        return groups

    def sizes(self, config: DistConfig) -> dict[str, int]:
        return {"fault_tolerant_groups": config.fault_tolerant_groups}

    def words(self, dims: ParallelDims, words: Words) -> Words:
        return (((GROUPS, f"{dims.fault_tolerant_groups} replica groups"),) if self.on(dims) else ()) + words

    def traffic(self, dims: ParallelDims, config, step: StepCost) -> list[Traffic]:
        """Each rank's gradients (its shards under fsdp: what it holds, local_params) all-reduced in fp32 with the
        same rank of every other group, G ranks spaced a group's world apart."""
        if not self.on(dims):
            return []
        split = group_split(dims.fault_tolerant_groups, dims.world_size, step.per_node, step.local_params * 4, 2)
        return [Traffic(GROUPS, "all-reduce", *split)]

    # ---------------------------------------------------------------- the launcher and the worker

    def launch_flags(self, config: Config, environ: Mapping[str, str]) -> list[str]:
        """dist.fault_tolerant_groups as distrib launch's flags: the launcher starts the Lighthouse, its log in
        run.dir, and the groups (or, given --replica-group or DISTRIB_REPLICA_GROUP, runs as one group of a run across
        nodes). A worker launches nothing."""
        dist = config.dist
        if dist.fault_tolerant_groups == 1 or is_worker(environ):
            return []
        return ["--replica-groups", str(dist.fault_tolerant_groups), "--min-replicas", str(dist.min_replicas),
                "--lighthouse-log", os.path.join(config.run.dir, "lighthouse.log")]

    def worker_config(self, config: Config, env: LaunchEnv) -> Config:
        """The config this worker's group runs: its own folders (run.dir/replica_group_g for g > 0)."""
        return fault_tolerance.group_config(config, env.replica_group)

    def around_training(self, training: Training):
        """This group's seat in the groups' quorum (None: one group), and how it takes the final state of a group
        that finished the run: from that group's checkpoint.dir."""
        if training.config.dist.fault_tolerant_groups == 1:
            return contextlib.nullcontext(None)
        finished = fault_tolerance.FinishedPeers(training.config, training.runtime.replica_group,
                                                 training.total_steps, training.checkpointer_at)
        return fault_tolerance.replica_groups(training.config, training.runtime, training.state, training.plan,
                                              training.recorder, finished)
