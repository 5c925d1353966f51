"""Goodput: the share of a job's GPU time spent training when its GPUs fail, restarted from checkpoints or, with replica
groups, healed from a live group; and the checkpoint interval that maximises it (Young 1974, Daly 2006).

The model (first order in the failure rate, failures independent and memoryless):

- The job's mean time between failures is M = 1 / (failures per GPU-hour x GPUs of the job, the groups' included).
- Restarts from checkpoints (Daly's first-order model): every interval tau of training a save blocks it delta, and a
  failure loses on average half an interval of work (tau / 2; plus the background write w under an async save, since
  the checkpoint in flight does not count yet) and the restart R. Wasted share = delta / tau + (tau / 2 + w + R) / M,
  least at Young/Daly's tau* = sqrt(2 delta M), where it is sqrt(2 delta / M) + (w + R) / M. Goodput = 1 - waste.
- G replica groups (dist.fault_tolerant_groups): a failure takes one group down. Every group stalls s (the
  Lighthouse's heartbeat timeout, measured 5.2-6.0 s with the step it retakes) and loses the step in flight t; the
  failed group's GPUs, 1/G of the job, are idle for its restart and heal D = R + h (h: a rank's state from its live
  peer over the inter-node link) while the others train on. Wasted share per failure = (s + t + D / G) / M. Only when
  every group is down at once does the job restart from a checkpoint: a group is down a share q = D / (G M + D) of
  the time, so that happens when one fails while the G - 1 others are down, a mean time M_all = (G M + D) /
  (G q^(G-1)), about M / q^(G-1), between whole-job restarts (all_down_mtbf); the restart terms above apply with
  M_all (its own optimum sqrt(2 delta M_all)). Goodput = 1 - delta / tau - (tau / 2 + w + R) / M_all
  - (s + t + D / G) / M.
- An async save assumes tau > w (one write at a time: a save that waits for the last one blocks the step longer).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from distrib.launch.lighthouse import HEARTBEAT_TIMEOUT_MS
from distrib.plan.machine import GB, Failures, Machine

if TYPE_CHECKING:
    from distrib.config import Config

HOUR = 3600.0
# An async save blocks the step while it copies a rank's state to host memory: about half a PCIe 5 x16 link's 64 GB/s
# (pageable shared memory, not pinned); the write goes on in the background.
STAGING_BANDWIDTH = 25 * GB
STALL_SECONDS = HEARTBEAT_TIMEOUT_MS / 1000  # a lost group holds the others until the Lighthouse gives it up


def mtbf_seconds(per_gpu_hour: float, gpus: int) -> float:
    """The job's mean time between failures: 1 / (rate x GPUs)."""
    return HOUR / (per_gpu_hour * gpus)


def optimal_interval(save_seconds: float, mtbf: float) -> float:
    """Young/Daly's checkpoint interval: sqrt(2 x save time x MTBF)."""
    return math.sqrt(2 * save_seconds * mtbf)


def restart_goodput(interval: float, save_seconds: float, mtbf: float, restart_seconds: float,
                    write_seconds: float = 0.0) -> float:
    """1 - (delta / tau + (tau / 2 + w + R) / M), at least 0 (interval math.inf: no checkpoint before the end)."""
    saves = save_seconds / interval if save_seconds else 0.0  # nothing to save: dist.cpu_offload's plan, see below
    waste = saves + (interval / 2 + write_seconds + restart_seconds) / mtbf
    return max(0.0, 1.0 - waste)


def all_down_mtbf(groups: int, mtbf: float, down_seconds: float) -> float:
    """Mean time between moments when all G groups are down at once: a group, up G M on average then down D, fails
    at 1 / (G M + D) and is down a share q = D / (G M + D) of the time; all are down when one fails while the G - 1
    others are: (G M + D) / (G q^(G-1)), about M / q^(G-1)."""
    cycle = groups * mtbf + down_seconds
    return cycle / (groups * (down_seconds / cycle) ** (groups - 1))


def groups_goodput(groups: int, interval: float, save_seconds: float, mtbf: float, restart_seconds: float,
                   heal_seconds: float, step_seconds: float, write_seconds: float = 0.0) -> float:
    """Goodput with G >= 2 replica groups: 1 - (s + t + (R + h) / G) / M - the restart terms over M_all."""
    down = restart_seconds + heal_seconds
    stalls = (STALL_SECONDS + step_seconds + down / groups) / mtbf
    whole = all_down_mtbf(groups, mtbf, down)
    return max(0.0, restart_goodput(interval, save_seconds, whole, restart_seconds, write_seconds) - stalls)


def checkpoint_writes(per_rank: int, mesh: dict, nproc_per_node: int, failures: Failures, async_save: bool) -> dict:
    """The save of a rank checkpointing per_rank bytes (its parameters and optimizer state): the bytes the fullest node
    writes (sharded: every rank its shards, replicas' copies shared out among them as torch.distributed.checkpoint
    does; ddp: rank 0 the whole state), the write's seconds at the storage's bandwidth and the seconds it blocks
    training (the write, or an async save's copy to host memory; a measured save_seconds replaces either). Under
    dist.cpu_offload on an accelerator the plan counts no state on the device, so none here: give --save-seconds."""
    node = per_rank if "shard" not in mesh else nproc_per_node * per_rank / mesh.get("replicate", 1)
    write = node / failures.storage_bandwidth
    blocked = per_rank / STAGING_BANDWIDTH if async_save else write
    source = "measured" if failures.save_seconds is not None else "async copy" if async_save else "estimated"
    return {"checkpoint_bytes_per_rank": per_rank, "checkpoint_bytes_per_node": node,
            "checkpoint_write_seconds": write,
            "save_seconds": blocked if failures.save_seconds is None else failures.save_seconds,
            "save_seconds_source": source}


def plan_goodput(config: Config, machine: Machine, mesh: dict, checkpoint_bytes_per_rank: int, step_bound: float
                 ) -> dict:
    """The plan's goodput figures for machine.world_size GPUs (every rank of the job, its replica groups' too):
    restarts at checkpoint.every_steps (None where the step time is unknown, or every_steps is 0: a failure loses the
    run so far) and at Young/Daly's interval; then G replica groups (the config's, or 2 as a what-if), each rank
    healing its checkpointed state from its peer over the inter-node link."""
    failures, every_steps = machine.failures, config.checkpoint.every_steps
    async_save = config.checkpoint.async_save != "off"
    mtbf = mtbf_seconds(failures.per_gpu_hour, machine.world_size)
    save = checkpoint_writes(checkpoint_bytes_per_rank, mesh, machine.nproc_per_node, failures, async_save)
    delta, restart = save["save_seconds"], failures.restart_seconds
    write = save["checkpoint_write_seconds"] if async_save else 0.0
    step = failures.step_seconds  # the communication bound is no step time: it only bounds the steps
    interval = every_steps * step if step and every_steps else None
    best = optimal_interval(delta, mtbf)
    out = {"failures_per_gpu_hour": failures.per_gpu_hour, "mtbf_seconds": mtbf, **save, "restart_seconds": restart,
           "step_seconds": step,
           "checkpoint_every_steps": every_steps, "checkpoint_interval_seconds": interval,
           "goodput": None if interval is None else restart_goodput(interval, delta, mtbf, restart, write),
           "optimal_checkpoint_interval_seconds": best,
           "optimal_checkpoint_every_steps": max(1, round(best / step)) if step else
           max(1, math.floor(best / step_bound)) if step_bound else None,
           "goodput_at_optimum": restart_goodput(best, delta, mtbf, restart, write)}
    groups = config.dist.fault_tolerant_groups
    if machine.world_size < 2:
        return {**out, "replica_groups": 1}
    size = groups if groups > 1 else 2
    heal = checkpoint_bytes_per_rank / machine.inter_node_bandwidth
    whole = all_down_mtbf(size, mtbf, restart + heal)
    best_whole = optimal_interval(delta, whole)

    def with_groups(tau: float) -> float:
        return groups_goodput(size, tau, delta, mtbf, restart, heal, step or step_bound, write)

    return {**out, "replica_groups": size, "replica_groups_planned": groups > 1, "stall_seconds": STALL_SECONDS,
            "heal_seconds": heal, "all_groups_down_mtbf_seconds": whole,
            "goodput_with_groups": None if interval is None else with_groups(interval),
            "groups_optimal_checkpoint_interval_seconds": best_whole,
            "goodput_with_groups_at_optimum": with_groups(best_whole)}


def duration(seconds: float) -> str:
    for unit, scale in (("days", 86400), ("h", HOUR), ("min", 60)):
        if seconds >= 2 * scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"


def rows(f: dict) -> list[tuple[str, str]]:
    """`distrib plan`'s goodput lines: restarts at the best interval (and the configured one, given a measured step
    time); the job's failures and what a failure costs; replica groups."""
    every_steps, best = f["checkpoint_every_steps"], f["optimal_checkpoint_every_steps"]
    at = "" if f["goodput"] is None else (f"{f['goodput']:.2%} with checkpoints every "
                                          f"{duration(f['checkpoint_interval_seconds'])} (checkpoint.every_steps "
                                          f"{every_steps} x {duration(f['step_seconds'])} a step), ")
    steps = (f" (--set checkpoint.every_steps={best})" if f["step_seconds"] else
             f" (checkpoint.every_steps at most {best} by the step's communication bound; --step-seconds for the "
             f"steps and the goodput of every_steps = {every_steps})" if best else " (--step-seconds for its steps)")
    lines = [("goodput", f"{at}{f['goodput_at_optimum']:.2%} at Young/Daly's interval sqrt(2 x save x MTBF) = "
                         f"{duration(f['optimal_checkpoint_interval_seconds'])}{steps}"),
             ("", f"job MTBF {duration(f['mtbf_seconds'])} ({f['failures_per_gpu_hour']:.3g} failures per GPU-hour x "
                  f"{f['world_size']} GPUs), save {duration(f['save_seconds'])} ({f['save_seconds_source']}; "
                  f"{f['checkpoint_bytes_per_node'] / GB:.3g} GB a node written in "
                  f"{duration(f['checkpoint_write_seconds'])}), restart {duration(f['restart_seconds'])}")]
    if f["replica_groups"] > 1:
        groups = (f"{f['goodput_with_groups']:.2%} at every_steps = {every_steps}" if f["goodput_with_groups"]
                  is not None else f"{f['goodput_with_groups_at_optimum']:.2%} with checkpoints every "
                  f"{duration(f['groups_optimal_checkpoint_interval_seconds'])}")
        lines.append(("", f"{f['replica_groups']} replica groups"
                          + ("" if f["replica_groups_planned"] else " (--set dist.fault_tolerant_groups=2)")
                          + f": {groups} (a lost group stalls the others {duration(f['stall_seconds'])}, "
                          f"restarts and heals in {duration(f['restart_seconds'] + f['heal_seconds'])}; "
                          f"all groups down once in {duration(f['all_groups_down_mtbf_seconds'])})"))
    return lines
