"""The cluster `distrib plan` is asked about (Machine: nodes, ranks, memory, bandwidths, failures) and the world it
lays a rank out in: torch's fake process group of the world's size, and the ranks one mesh spans."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator

from distrib.config import Config
from distrib.distributed import dimensions
from distrib.torch_private import register_fake_backend

GIB, GB = 2**30, 1e9
# Llama 3 405B (its paper, 3.3.4): 419 unexpected interruptions in 54 days of 16,384 H100s.
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16_384)
# From a failure to training again: noticing it, the scheduler's requeue, the launch and rendezvous, the checkpoint's
# load. No peer publishes one figure; 5 minutes is an assumption for a job that restarts itself (give a measured one).
RESTART_SECONDS = 300.0
# Llama 3's checkpoint storage (Tectonic): 2 TB/s sustained for its 2,048 nodes of 8 GPUs, about 1 GB/s a node.
STORAGE_BANDWIDTH_PER_NODE = 1 * GB


@dataclass(frozen=True, slots=True)
class Failures:
    """The failure and storage keys of `distrib plan` (--failures-per-gpu-hour, --restart-seconds, --storage-bandwidth,
    --save-seconds, --step-seconds). save_seconds: a measured save (a run's save_blocked_s), else estimated from the
    checkpoint's bytes; step_seconds: a measured step, else the plan's communication bound."""

    per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    restart_seconds: float = RESTART_SECONDS
    storage_bandwidth: float = STORAGE_BANDWIDTH_PER_NODE  # bytes/s each node writes to checkpoint storage
    save_seconds: float | None = None
    step_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Machine:
    """The cluster asked about; the defaults are H100/H200 nodes (NVLink 4: 450 GB/s per GPU and direction;
    one 400 Gb/s NIC per GPU: 50 GB/s; 80 GiB per GPU, 2 TiB of host memory per node)."""

    nnodes: int
    nproc_per_node: int
    device_memory: float = 80 * GIB
    intra_node_bandwidth: float = 450 * GB
    inter_node_bandwidth: float = 50 * GB
    host_memory: float = 2048 * GIB  # per node: a DGX H100's 2 TiB
    failures: Failures = Failures()  # failure rate, restart, checkpoint storage: the goodput line (plan.goodput)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Rank 0 of a fake group of world_size ranks: collectives return at once, meshes of any shape can be built."""
    import torch.distributed as dist
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh_machine(config: Config, machine: Machine) -> Machine:
    """The ranks one mesh spans: the machine's, or one of the worlds a degree splits them into (fault-tolerant replica
    groups: world / G ranks each, on whole nodes or within one), a one-line ConfigError when they do not tile it."""
    worlds = dimensions.worlds(config.dist, machine.world_size, machine.nproc_per_node)
    ranks = machine.world_size // worlds
    return machine if worlds == 1 else replace(machine, nnodes=max(1, ranks // machine.nproc_per_node),
                                               nproc_per_node=min(ranks, machine.nproc_per_node))
