"""What a CPU run's host allocator holds beyond a step's own bytes, for `distrib plan`: the allocator its workers will
run on (distrib.launch.allocator), whether they return what a step frees (distrib.distributed.host_heap), its slack."""

from __future__ import annotations

import torch
import torch.nn as nn

from distrib.distributed.strategies import Strategy

# The host allocator's slack on a CPU run: what a step frees and the allocator keeps but does not reuse, by what the run
# frees and the allocator that will run (host_allocator). Measured by scripts/bench_startup.py --plan (each worker's
# peak RSS above a tiny GPT's run, world 4, AdamW; plan / measured): ddp keeps its freed memory, about its transient
# bytes again (KEPT_SLACK; 6M and 25M GPTs 0.98-1.0 under glibc and tcmalloc). A sharded model under 64 MiB keeps it too
# (distrib.distributed.host_heap), block by block between the activations: each block's gathered parameters,
# unsharded gradients and their reduce-scatter copy, which glibc's heap does not reuse: 3.5-5.6x the model's bytes
# over and above (3M, 6M and 14M GPTs), tcmalloc 0.25-0.9x (SHARDED_KEPT_SLACK; jemalloc not measured: as tcmalloc). A
# sharded model of 64 MiB or more returns it (tcmalloc's decommit, glibc's 64 KiB mmap threshold): none (the 25M GPT
# 0.88 and the 104M 0.95 either way). On an accelerator 0: its caching allocator's own slack is not modelled.
KEPT_SLACK = 1.0  # x the activations and the gathered parameters
SHARDED_KEPT_SLACK = {"glibc": 4.3, "tcmalloc": 0.6, "jemalloc": 0.6}  # x the model's fp32 bytes per tp rank


def host_allocator(environ=None) -> str:
    """The allocator a CPU run's workers will run on: the one LD_PRELOAD names, else the one distrib's launcher
    preloads on this host (distrib.launch.allocator: tcmalloc where it is installed), else glibc."""
    import os

    from distrib.launch.allocator import LIBRARIES, chosen, worker_preload

    environ = os.environ if environ is None else environ
    preloaded = environ.get("LD_PRELOAD", "")
    if preloaded:
        return next((name for name in LIBRARIES if name in preloaded), "glibc")
    return chosen(environ) if worker_preload(environ, num_gpus=0) else "glibc"


def _fp32_bytes(model: nn.Module) -> int:
    """The parameters in fp32, as the strategy builds them (plan's model is in the compute dtype), and the buffers."""
    return sum(4 * p.numel() for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())


def returns_freed_memory(strategy: Strategy, model: nn.Module) -> bool:
    """Whether a CPU run's workers give freed host memory back (distrib.distributed.strategies.fsdp's rule)."""
    from distrib.distributed.strategies.fsdp import RETURN_FREED_MEMORY_FROM_BYTES

    return strategy.sharded_state and _fp32_bytes(model) >= RETURN_FREED_MEMORY_FROM_BYTES


def allocator_slack(model: nn.Module, device: torch.device, sharded: bool, transient: int, tensor_parallel: int = 1,
                    allocator: str | None = None) -> int:
    """The host allocator's slack per rank of a CPU run (KEPT_SLACK, SHARDED_KEPT_SLACK): transient is the bytes of
    the activations and the parameters gathered in flight."""
    from distrib.distributed.strategies.fsdp import RETURN_FREED_MEMORY_FROM_BYTES

    if device.type != "cpu":
        return 0
    if not sharded:
        return round(KEPT_SLACK * transient)
    if _fp32_bytes(model) >= RETURN_FREED_MEMORY_FROM_BYTES:
        return 0
    return round(SHARDED_KEPT_SLACK[allocator or host_allocator()] * _fp32_bytes(model) / tensor_parallel)


def described_allocator(strategy: Strategy, model: nn.Module) -> str:
    return f"{host_allocator()}, {'returning' if returns_freed_memory(strategy, model) else 'keeping'} freed memory"
