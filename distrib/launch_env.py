"""What a launched worker has from its launcher, beside torchrun's variables: the names of the environment variables
distrib launch writes and the worker's runtime reads (distrib.distributed.runtime.read_launch_env, the one place that
reads them), the signals that ask a worker to stop, and the tie of a started process to its parent. No torch and no
distrib import: the launch modules, the lifeline and the runtime all import it downward."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

# What a worker of fault-tolerant replica group g reads: its group, and where torchft's Lighthouse is.
GROUP_VAR = "DISTRIB_REPLICA_GROUP"
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
# A file of distrib launch's own in which a worker that dumps its flight recorder on a hang writes the folder of the
# dumps (run.dir/hang), so that the launcher compares them once the workers ended.
HANG_NOTE_VAR = "DISTRIB_HANG_NOTE"

# Signals the elastic agent, SLURM or a user send to stop a worker; the lifeline relays them to the worker.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int | None = None) -> bool:
    """Asks Linux to SIGKILL this process when its parent ends (SIGKILL of the parent included), then checks that
    the parent did not already end before the request (the race prctl's manual warns of): then this process is
    an orphan and ends now. parent_pid is the parent it should have; None checks only for adoption by init (pid 1).
    False where there is no prctl (not Linux): nothing is tied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    parent = os.getppid()
    if parent == 1 or (parent_pid is not None and parent != parent_pid):
        os.kill(os.getpid(), signal.SIGKILL)
    return True
