"""A run's life and death: workers end with their launcher (SIGKILL included) on every launch path, a stopped or hung
rank is named within dist.timeout_s with its own exit code, a stop signal at any moment ends in the preemption code
only when nothing is lost, and every line of a failing run is whole."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from distrib.distributed.peers import SILENT_AFTER_S, PeerWatch
from distrib.errors import EXIT_HUNG, EXIT_PREEMPTED
from distrib.launch import exits
from tests.helpers.processes import REPO

# ---------------------------------------------------------------- lifelines and exit codes, no launch


def test_a_signal_is_a_preemption_only_when_nothing_is_lost():
    term, usr1, hup = signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP
    assert exits.signal_exit_code(term, []) == EXIT_PREEMPTED  # no worker yet: nothing to lose
    assert exits.signal_exit_code(usr1, []) == EXIT_PREEMPTED
    assert exits.signal_exit_code(term, [75, 75]) == EXIT_PREEMPTED  # every worker checkpointed
    assert exits.signal_exit_code(term, [EXIT_HUNG, None]) == EXIT_HUNG  # a hung rank: no checkpoint
    assert exits.signal_exit_code(term, [75, None]) == 128 + term  # one worker killed before it checkpointed
    assert exits.signal_exit_code(term, [-15, -15]) == 128 + term  # a plain script that ends on SIGTERM
    assert exits.signal_exit_code(term, [0, 0]) == 0
    assert exits.signal_exit_code(hup, []) == 128 + hup


def test_a_stop_after_a_peer_failed_kills_at_once_only_inside_a_replica_group(tmp_path, monkeypatch):
    from distrib.launch.lifeline import Status, doomed_by_a_lost_peer, write_status
    from distrib.launch.replica_groups import GROUP_VAR

    monkeypatch.setenv(GROUP_VAR, "1")
    doomed = doomed_by_a_lost_peer(tmp_path)
    write_status(tmp_path, "0", Status(10, 11, -9))  # the last attempt's dead worker
    write_status(tmp_path, "1", Status(20, 21, None))
    assert not doomed()  # a new attempt: nobody lost yet
    for code, lost in ((EXIT_PREEMPTED, False), (0, False), (-9, True), (1, True)):
        write_status(tmp_path, "1", Status(22, 23, code))
        assert doomed() is lost, code
    monkeypatch.delenv(GROUP_VAR)
    assert not doomed_by_a_lost_peer(tmp_path)()  # an ordinary run: its workers checkpoint on the stop signal


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


def test_a_lost_peer_is_the_rank_that_went_silent_not_those_that_said_so_and_ended(monkeypatch):
    """World 4, rank 3's collective broke: ranks 0 and 2 arrived at the failure too (they said so, then ended, so
    they beat no more); rank 1 went silent without arriving (it was killed). Only rank 1 is lost."""
    import torch.distributed as dist

    from distrib.distributed import peers

    monkeypatch.setattr(peers, "SILENT_AFTER_S", 0.5)  # a silence this long means stopped: no 3 s wait here
    store = dist.HashStore()
    watches = [PeerWatch(lambda: store, rank, 4, timeout_s=40.0) for rank in range(4)]
    for watch in watches:
        watch.beat()
    for rank in (0, 2):
        store.set(f"arrived/{rank}", "after step 4")
    text = watches[3].diagnose("lost")
    assert text.startswith("rank 1 (host ") and text.count("rank ") == 1, text


def test_the_survivors_of_a_lost_rank_name_it_once_with_the_same_exit_code(monkeypatch):
    """World 4, rank 1 killed: ranks 0, 2 and 3 (beating, in threads here as in their processes) each see their
    collective break at once. Each names rank 1 alone and ends with EXIT_HUNG, and exactly one of them says its line
    (the first to claim it in the store); without heartbeats (no store to claim in) a rank says it itself, as no
    other can then."""
    import threading

    import torch.distributed as dist

    from distrib.distributed import peers
    from distrib.distributed.runtime import collective_timeouts
    from distrib.errors import PeerLostError
    from distrib.launch.reporting import told_elsewhere

    monkeypatch.setattr(peers, "SILENT_AFTER_S", 0.5)
    monkeypatch.setattr(peers, "BEAT_INTERVAL_S", 0.05)  # the survivors beat often: only rank 1 is silent for 0.5 s
    store = dist.HashStore()
    watches = [PeerWatch(lambda: store, rank, 4, timeout_s=40.0) for rank in range(4)]
    watches[1].beat()  # its one beat before it was killed
    errors = {}

    def survivor(rank: int) -> None:
        try:
            with collective_timeouts(3.0, lambda: "after step 4", watches[rank]):
                raise RuntimeError("[pair.cc:1] Connection closed by peer [h]:1. This is typically caused by ...")
        except PeerLostError as e:
            errors[rank] = e

    survivors = [watches[rank].start() for rank in (0, 2, 3)]
    threads = [threading.Thread(target=survivor, args=(watch.rank,)) for watch in survivors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for watch in survivors:
        watch.stop()
    assert sorted(errors) == [0, 2, 3], errors
    for error in errors.values():
        assert re.findall(r"\brank (\d+)", str(error)) == ["1"] and error.exit_code == EXIT_HUNG, error
    assert len([rank for rank, error in errors.items() if not told_elsewhere(error)]) == 1, errors
    with pytest.raises(PeerLostError) as alone:
        with collective_timeouts(3.0, lambda: "after step 4"):
            raise RuntimeError("Connection closed by peer")
    assert not told_elsewhere(alone.value)


# ---------------------------------------------------------------- the entry point's stop handlers


def test_the_entry_point_takes_the_stop_signals_before_it_imports_anything():
    """`distrib` (console script and python -m) installs its handlers first: its module imports os and signal only,
    and entry() sets the handlers before it imports the CLI (which imports the launcher, the config, then torch)."""
    import ast
    import tomllib

    import distrib.__main__ as main
    from distrib.launch.reporting import REPORTS_VAR

    tree = ast.parse(Path(main.__file__).read_text())
    imports = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    assert imports == ["os", "signal"] and not any(isinstance(node, ast.ImportFrom) for node in tree.body)
    entry = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "entry")
    kinds = [type(node).__name__ for node in entry.body[1:]]  # after the docstring
    assert kinds[:2] == ["For", "ImportFrom"], kinds  # the handlers, then the CLI
    assert (main._EXIT_PREEMPTED, main._REPORTS_VAR, main.STOP_SIGNALS) == \
        (EXIT_PREEMPTED, REPORTS_VAR, exits.STOP_SIGNALS)  # the copies agree
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"distrib": "distrib.__main__:entry"}


def test_a_stop_before_the_later_handlers_ends_with_75_and_one_line(monkeypatch):
    """Said by the process itself; a worker of distrib launch stays quiet (the launcher says how its workers ended)."""
    import distrib.__main__ as main

    written = []
    monkeypatch.setattr(os, "write", lambda fd, data: written.append((fd, data.decode())))
    monkeypatch.setattr(os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    for reports in ("", "1"):
        monkeypatch.setenv(main._REPORTS_VAR, reports)
        with pytest.raises(SystemExit) as ended:
            main._stopped(signal.SIGTERM, None)
        assert ended.value.code == EXIT_PREEMPTED
    [(fd, line)] = written
    assert fd == 2 and line.startswith("distrib: stopped by SIGTERM outside the training steps") and \
        line.count("\n") == 1 and "exit code 75" in line


def test_a_preemption_is_said_once_by_rank_0(monkeypatch, capfd):
    """Every rank ends with 75; only the one whose recorder writes (rank 0) says the line."""
    import distrib.worker
    from distrib.cli import train as train_command
    from distrib.errors import Preempted

    for announce in (True, False):
        def stopped(config, announce=announce):
            raise Preempted(7, "ckpt/step_7.pt", announce=announce)
        monkeypatch.setattr(distrib.worker, "run_training", stopped)
        assert train_command.worker(None) == EXIT_PREEMPTED
        said = capfd.readouterr().err
        assert said.count("distrib: preempted at step 7; checkpoint ckpt/step_7.pt") == (1 if announce else 0), said
