"""The host allocator of the launcher's CPU workers: tcmalloc, preloaded through LD_PRELOAD where it is installed,
unless the user chose otherwise (DISTRIB_HOST_ALLOCATOR, their own LD_PRELOAD, or glibc's malloc tuning).

Why tcmalloc (README, "The host allocator"; scripts/bench_allocator.py): a training step on the CPU frees and takes
back the same large tensors every step (activations, gradients, and under fsdp each block's gathered parameters).
glibc's malloc either keeps them in its heap, where a sharded model's gathers held its workers at 4.3-5.0x the model's
bytes, or (distrib's own rule for glibc, distrib.distributed.host_heap) maps and faults each one in anew, which made
system time most of a step; tcmalloc reuses freed spans at no fault, in about 1.4x of the model's bytes."""

from __future__ import annotations

import ctypes.util
import os
from typing import Mapping

from distrib.errors import UserError

CHOICE_VAR = "DISTRIB_HOST_ALLOCATOR"
DEFAULT = "tcmalloc"
# Debian's and Ubuntu's paths (libtcmalloc-minimal4, libjemalloc2), then the dynamic linker's search by name
LIBRARIES = {"tcmalloc": ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                          "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4", "tcmalloc_minimal"),
             "jemalloc": ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                          "jemalloc")}
PACKAGES = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}
# The user tunes glibc's malloc: then glibc stays, as they set it
GLIBC_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def find_library(name: str) -> str | None:
    """The allocator's shared library: a known path that exists, else what the dynamic linker finds by name."""
    *paths, stem = LIBRARIES[name]
    found = next((path for path in paths if os.path.exists(path)), None)
    return found or ctypes.util.find_library(stem)


def user_tunes_glibc(environ: Mapping[str, str]) -> bool:
    return any(key in environ for key in GLIBC_KEYS) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def chosen(environ: Mapping[str, str]) -> str:
    choice = environ.get(CHOICE_VAR, DEFAULT).strip().lower() or DEFAULT
    if choice not in (*LIBRARIES, "glibc"):
        raise UserError(f"{CHOICE_VAR}={environ[CHOICE_VAR]!r}: not a host allocator distrib knows; set it to "
                        f"{', '.join(LIBRARIES)} or glibc (glibc's malloc with distrib's thresholds), or unset it")
    return choice


def worker_preload(environ: Mapping[str, str], num_gpus: int) -> dict[str, str]:
    """What the launcher adds to its workers' environment for their host allocator: LD_PRELOAD of the chosen one
    (tcmalloc by default) on a host without GPUs where it is installed; nothing where the user preloads a library
    of their own, tunes glibc's malloc, or chose glibc. (GPU workers' large tensors live on the device.)"""
    choice = chosen(environ)
    if num_gpus or choice == "glibc" or environ.get("LD_PRELOAD") or user_tunes_glibc(environ):
        return {}
    path = find_library(choice)
    return {"LD_PRELOAD": path} if path else {}


def running(environ: Mapping[str, str] = os.environ) -> str:
    """The allocator this process runs on, in words for the run's log (of a CPU worker)."""
    preloaded = environ.get("LD_PRELOAD", "")
    name = next((name for name in LIBRARIES if name in preloaded), None)
    if name:
        return f"{name} (preloaded by LD_PRELOAD; {CHOICE_VAR}=glibc for glibc's malloc)"
    if preloaded:
        return f"LD_PRELOAD's ({preloaded}) or glibc's"
    if user_tunes_glibc(environ):
        return "glibc, as the environment tunes it"
    choice = chosen(environ)
    if choice == "glibc":
        return f"glibc, with distrib's thresholds ({CHOICE_VAR}=glibc)"
    path = find_library(choice)  # installed, but this process was not started by distrib's launcher
    how = f"start through distrib's launcher, or set LD_PRELOAD={path}" if path else \
        f"apt-get install {PACKAGES[choice]}"
    return f"glibc, with distrib's thresholds ({choice} was not preloaded: {how})"
