"""A run's life and death: workers end with their launcher (SIGKILL included) on every launch path, a stopped or hung
rank is named within dist.timeout_s with its own exit code, a stop signal at any moment ends in the preemption code
only when nothing is lost, and every line of a failing run is whole."""

from __future__ import annotations

import os
import signal
import socket
import time

from distrib.distributed.peers import SILENT_AFTER_S, PeerWatch
from distrib.errors import EXIT_HUNG, EXIT_PREEMPTED
from distrib.launch import launcher

# ---------------------------------------------------------------- lifelines and exit codes, no launch


def test_a_signal_is_a_preemption_only_when_nothing_is_lost():
    term, usr1, hup = signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP
    assert launcher.signal_exit_code(term, []) == EXIT_PREEMPTED  # no worker yet: nothing to lose
    assert launcher.signal_exit_code(usr1, []) == EXIT_PREEMPTED
    assert launcher.signal_exit_code(term, [75, 75]) == EXIT_PREEMPTED  # every worker checkpointed
    assert launcher.signal_exit_code(term, [EXIT_HUNG, None]) == EXIT_HUNG  # a hung rank: no checkpoint
    assert launcher.signal_exit_code(term, [75, None]) == 128 + term  # one worker killed before it checkpointed
    assert launcher.signal_exit_code(term, [-15, -15]) == 128 + term  # a plain script that ends on SIGTERM
    assert launcher.signal_exit_code(term, [0, 0]) == 0
    assert launcher.signal_exit_code(hup, []) == 128 + hup


def test_the_diagnosis_names_who_did_not_arrive_and_whether_it_still_beats():
    """Three ranks on one store: rank 2 arrived at the failed collective too, rank 1 did not and stopped beating."""
    import torch.distributed as dist

    store = dist.HashStore()
    watches = [PeerWatch(lambda: store, rank, 3, timeout_s=40.0) for rank in range(3)]
    watches[0].where = lambda: "after step 7"
    for watch in watches:
        watch.beat()  # one beat each, as start() does; no threads: rank 1 then stays silent
    store.set("arrived/2", "after step 7")
    started = time.monotonic()
    text = watches[0].diagnose("timeout")
    # Every rank is accounted for (two arrived, one silent) once a silence is long enough to mean stopped: 3 s,
    # not the 10 s grace that a 40 s timeout gives a busy host.
    assert watches[0].grace_s() == 10.0
    assert SILENT_AFTER_S <= time.monotonic() - started < watches[0].grace_s()
    assert text == f"rank 1 (host {socket.gethostname()}, pid {os.getpid()}, before training; no heartbeat since: " \
                   "stopped, killed, or its host is gone)"
