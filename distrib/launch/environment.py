"""What the launcher sets in the environment its workers inherit, beside torchrun's variables: CPU threads per worker,
loopback sockets on one node, the lifeline each worker starts under, and the flag that the launcher reports their
ends. torch's agent passes os.environ on to every worker, so these are written there, and restored after."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

from distrib.launch.reporting import REPORTS_VAR
from distrib.launch_env import HANG_NOTE_VAR


def cpu_threads(environ: Mapping[str, str], num_workers: int, num_gpus: int) -> str | None:
    """OMP_NUM_THREADS for each CPU worker: this process's cores shared out (torchrun gives 1); None to leave as is."""
    if "OMP_NUM_THREADS" in environ or num_gpus:
        return None
    return str(max(1, len(os.sched_getaffinity(0)) // max(num_workers, 1)))


def oversubscribed(num_workers: int, num_gpus: int, num_cores: int | None = None) -> str | None:
    """A warning when a CPU run starts more workers on this node than there are cores this process may run on: they
    take turns on the cores, and every step waits for the slowest of them. None when they fit, or on GPUs."""
    num_cores = num_cores or len(os.sched_getaffinity(0))
    if num_gpus or num_workers <= num_cores:
        return None
    return (f"distrib launch: warning: --nproc-per-node {num_workers} starts {num_workers} CPU workers (no GPU is "
            f"visible) on {num_cores} cores: they take turns on the cores and each step waits for the slowest; "
            f"--nproc-per-node {num_cores} or fewer gives each worker a core of its own")


def private_sockets(environ: Mapping[str, str], max_nodes: int) -> dict[str, str]:
    """On one node, the workers' gloo and NCCL connections on the loopback interface, so that no process of the
    run listens on an address another machine can reach (the stores: distrib.launch.rendezvous); a user's own
    choice of interface stands."""
    if max_nodes > 1:
        return {}
    from distrib.launch.rendezvous import loopback_interface

    return {key: loopback_interface() for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if key not in environ}

@contextlib.contextmanager
def lifelines(args: argparse.Namespace) -> Iterator[Path]:
    """Starts every worker under distrib.lifeline (it dies with this process and records its exit code in the
    folder yielded) through torchrun's PYTHON_EXEC: the interpreter torch's agent runs workers with. The workers'
    HANG_NOTE_VAR names the file `hang_note` beside that folder."""
    with tempfile.TemporaryDirectory(prefix="distrib-launch-") as folder:
        status = Path(folder, "status")
        status.mkdir()
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        restore = f"PYTHON_EXEC={shlex.quote(python)}; export PYTHON_EXEC" if "PYTHON_EXEC" in os.environ \
            else "unset PYTHON_EXEC"
        wrapper = Path(folder, "python-in-lifeline")  # the "binary" torch's log lines name
        wrapper.write_text(f"#!/bin/sh\n{restore}\nexec {shlex.quote(sys.executable)} -m distrib.launch.lifeline "
                           f"--parent {os.getpid()} --status {shlex.quote(str(status))} {shlex.quote(python)} "
                           '"$@"\n')
        wrapper.chmod(0o755)
        previous = {key: os.environ.get(key) for key in ("PYTHON_EXEC", HANG_NOTE_VAR)}
        # --no-python and --run-path start no interpreter of ours: those workers run without a lifeline.
        os.environ["PYTHON_EXEC"] = str(wrapper)
        os.environ[HANG_NOTE_VAR] = str(Path(folder, "hang_note"))
        try:
            yield status
        finally:
            for key, value in previous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@contextlib.contextmanager
def reporting_env() -> Iterator[None]:
    """REPORTS_VAR set for the workers while inside: the launcher reports how they end (reporting.errors_reported)."""
    previous = os.environ.get(REPORTS_VAR)
    os.environ[REPORTS_VAR] = "1"  # the one writer of the launch environment; torch's agent passes it on
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(REPORTS_VAR, None)
        else:
            os.environ[REPORTS_VAR] = previous

