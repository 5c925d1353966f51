"""How a worker whose tensors live in host memory keeps the memory it frees when it runs on glibc's malloc: glibc's
thresholds, set once per process unless the user's environment sets them. Under distrib's launcher a CPU worker runs
on tcmalloc where it is installed (distrib.launch.allocator, which says why); then nothing here applies. This is the
fallback: glibc, or a worker started by plain torchrun or a user's script.

Why: torch allocates CPU tensors with the C library's malloc, and glibc hands the freed top of its heap back to the
system whenever more than its trim threshold (128 KiB to 64 MiB, adjusted as it goes) is free there, then faults the
pages back in, zero-filled, at the next allocation. A training step frees and re-takes the same memory every step:
its activations and gradients, and under FSDP each block's gathered parameters in forward and again in backward.
On the bench GPT that was 2,600 page faults a step under ddp and 9,000 under fsdp (0 in the hand loop, whose
zero_grad sits between forward and backward), 3-8% of a step's CPU time. Keeping the freed memory in the process
is what CUDA's caching allocator does on a GPU; the resident memory then stays at the step's peak, which it
reaches every step anyway. Blocks of 32 MiB and more (glibc's own upper bound for its threshold) are still mapped
alone and returned when freed.

The exception, return_freed_memory: a sharded model of 64 MiB or more on the CPU (distrib.distributed.strategies.fsdp)
frees whole gathered parameters block by block, and kept in the heap they held the fsdp workers of a 203M GPT at
1.8-2.1x its bytes instead of 0.92x (docs/performance.md, "The host allocator"); there every block of 64 KiB and
more is mapped alone and returned when freed, at the cost of faulting it in anew."""

from __future__ import annotations

import ctypes
import os
import platform

from distrib.launch.allocator import LIBRARIES

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its own dynamic threshold stops
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of freed heap top: in practice all of a step's churn
RETURN_MMAP_THRESHOLD = 64 << 10
# Set by the user (bench_startup's --mmap-threshold, or to return memory sooner): then glibc is left as told.
USER_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory(environ=os.environ) -> bool:
    """Raises glibc's trim and mmap thresholds for this process; returns whether it did (False off glibc, or where
    the environment sets malloc's tuning itself)."""
    mallopt = _mallopt(environ)
    # The mmap threshold first: setting either fixes both (glibc stops adjusting them once one is set).
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
        and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def return_freed_memory(environ=os.environ) -> bool:
    """Large tensors go back to the system when freed: under tcmalloc its aggressive decommit, on glibc an mmap
    threshold of 64 KiB for this process; returns whether it did (False off both, or where the environment tunes the
    allocator itself)."""
    if _tcmalloc_property() is not None:
        return _tcmalloc_decommit(environ)
    mallopt = _mallopt(environ)
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, RETURN_MMAP_THRESHOLD))


def _tcmalloc_property():
    """tcmalloc's MallocExtension_SetNumericProperty where this process runs on tcmalloc (gperftools), else None."""
    setter = getattr(ctypes.CDLL(None), "MallocExtension_SetNumericProperty", None)
    if setter is not None:
        setter.argtypes, setter.restype = [ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int
    return setter


def _tcmalloc_decommit(environ) -> bool:
    # tcmalloc keeps freed spans to reuse them, but a sharded model's gathers, gradients and activations, freed block
    # by block, left them cut so that its fsdp workers held 0.2-0.5x more of the model's bytes than glibc's mapped
    # blocks (scripts/bench_allocator.py); decommitting free spans at once gives that back.
    told = any(key.startswith("TCMALLOC_") for key in environ)  # the user tunes tcmalloc: it stays as told
    return not told and bool(_tcmalloc_property()(b"tcmalloc.aggressive_memory_decommit", 1))


def _mallopt(environ):
    """glibc's mallopt, or None off glibc, where the user's environment tunes malloc (then glibc is left as told),
    and where another allocator is preloaded (its malloc serves the tensors; glibc's thresholds would mean nothing)."""
    told = any(key in environ for key in USER_KEYS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
    preloaded = any(name in environ.get("LD_PRELOAD", "") for name in LIBRARIES)
    return None if platform.libc_ver()[0] != "glibc" or told or preloaded else ctypes.CDLL(None).mallopt
