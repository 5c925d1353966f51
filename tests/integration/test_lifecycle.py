"""A run's life and death: workers end with their launcher (SIGKILL included) on every launch path, a stopped or hung
rank is named within dist.timeout_s with its own exit code, a stop signal at any moment ends in the preemption code
only when nothing is lost, and every line of a failing run is whole. (A rank killed beside DataLoader workers and
restarted: test_resume.py, whose 2-worker reference runs share one launch.)"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distrib import cli
from distrib.errors import EXIT_HUNG, EXIT_PREEMPTED
from distrib.launch.lifeline import Status, read_statuses, write_status
from tests.helpers import launch_support
from tests.helpers.launch_support import CLUSTER_CONFIG, PROBE, REPO, SMALL, Launches, clean_env, distrib_cmd, run_one
from tests.helpers.processes import EVENT_S, descendants, wait_for

LONG = [*SMALL, "--set", "train.max_steps=100000", "--set", "train.log_every=1"]  # runs until stopped

def probe_env(**extra: str) -> dict[str, str]:
    """The environment with the repository root on PYTHONPATH, for probe_env's model factories."""
    return clean_env(PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
                     **extra)


def _environ(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        raw = Path(f"/proc/{pid}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return {}


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie (an orphan's zombie waits for init to reap it)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for signum (SigCgt in /proc/PID/status): its Python code has started."""
    with contextlib.suppress(OSError, StopIteration):
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
        return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _workers(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (not their lifelines)."""
    found = {}
    for pid in descendants(launcher_pid):
        rank = _environ(pid).get("RANK")
        if rank is not None and "distrib.launch.lifeline" not in _cmdline(pid):
            found[int(rank)] = pid
    return found


def _wait_until(condition, timeout: float, what: str, launches: Launches):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    launches.close()
    raise AssertionError(f"no {what} after {timeout}s:\n{_stderr(launches, 0)[-4000:]}")


def _stderr(launches: Launches, index: int) -> str:
    return Path(f"{launches.procs[index][1]}.err").read_text()


def _proc(launches: Launches, index: int = 0) -> subprocess.Popen:
    return launches.procs[index][0]


def test_lifeline_records_and_passes_on_how_its_worker_ended(tmp_path):
    for code, script in ((7, "raise SystemExit(7)"), (-signal.SIGKILL, "import os; os.kill(os.getpid(), 9)")):
        status = tmp_path / f"status{code}"
        status.mkdir()
        done = subprocess.run([sys.executable, "-m", "distrib.launch.lifeline", "--parent", str(os.getpid()),
                               "--status", str(status), sys.executable, "-c", script], timeout=EVENT_S, env=clean_env())
        assert done.returncode == code
        [worker] = read_statuses(status)
        assert worker.code == code and worker.worker_pid != worker.pid
    write_status(tmp_path, "0", Status(10, 11, 1))
    write_status(tmp_path, "1", Status(12, 13, None))
    assert read_statuses(tmp_path) == [Status(12, 13, None)]  # the latest attempt only


# ---------------------------------------------------------------- real launches (2 CPU workers each)


def _kill_cases():
    train = ["train", "--config", CLUSTER_CONFIG, *LONG]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return {
        "train": lambda out: distrib_cmd(*train[:1], "--nproc-per-node", "2", *train[1:], "--set", f"run.dir={out}"),
        "torchrun": lambda out: [*torchrun, "-m", "distrib", *map(str, train), "--set", f"run.dir={out}"],
    }


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", ["train", "torchrun"])
def test_workers_end_with_their_launcher_even_on_sigkill(tmp_path, path):
    """distrib's launcher, whose lifelines SIGKILL a worker of any kind (here the trainer's, which catch SIGTERM to
    checkpoint: a plain script's die the same way), and torchrun."""
    out = tmp_path / "out"
    out.mkdir()
    with Launches(tmp_path) as launches:
        launches.start(_kill_cases()[path](out))
        workers = _wait_until(lambda: len(_workers(_proc(launches).pid)) == 2 and _workers(_proc(launches).pid),
                              EVENT_S, "2 workers", launches)
        time.sleep(3)  # past their start: the tie must hold while they work, not only while they start
        tree = descendants(_proc(launches).pid)
        os.kill(_proc(launches).pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # the kernel kills them at once; a loaded machine may take a while to reap
        while time.monotonic() < deadline and any(map(_alive, tree)):
            time.sleep(0.2)
        left = [f"{pid}: {_cmdline(pid)[:120]}" for pid in tree if _alive(pid)]
        assert not left, f"60 s after the launcher's SIGKILL ({path}), still running: {left}; workers {workers}"


@pytest.mark.timeout(900)
def test_a_stopped_rank_ends_the_run_within_the_timeout_and_is_named_with_the_collective(tmp_path):
    """World size 3, dist.timeout_s = 20: rank 1 stops (SIGSTOP) in its third forward, outside any collective. The
    run ends within the timeout plus 20 s with EXIT_HUNG, the ranks' line naming rank 1, its host and last step,
    every rank's flight-recorder trace in run.dir/hang (rank 1's written once the launcher let it run again, after
    which it ends at once), and the launcher's last line naming the collective that rank 1 did not enter.
    Meanwhile no process of the run (launcher, lifelines, workers) listens on an address another machine could
    reach: c10d stores have no authentication; the store and each worker's gloo listen on loopback."""
    timeout_s = 20
    run = tmp_path / "run"
    cmd = distrib_cmd("train", "--nproc-per-node", "3", "--config", CLUSTER_CONFIG, *LONG, "--set",
                      "train.global_batch_size=48",  # the config's 64 does not divide by 3
                      "--set", "model.factory=tests.helpers.probe_env:pausing_network",
                      "--set", f"dist.timeout_s={timeout_s}", "--set", f"run.dir={run}")
    with Launches(tmp_path) as launches:
        launches.start(cmd, probe_env())
        _wait_until(lambda: "probe: rank 1 pauses" in _stderr(launches, 0), EVENT_S, "a paused rank", launches)
        workers = _workers(_proc(launches).pid)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        listening = launch_support.listening_addresses(_proc(launches).pid)
        [done] = launches.wait(timeout=EVENT_S)
        seconds = time.monotonic() - stopped
    assert len(listening) >= 4, listening  # the launcher's store and the 3 workers' gloo
    assert all(ipaddress.ip_address(address).is_loopback for pairs in listening.values() for address, _ in pairs), \
        listening
    assert done.returncode == EXIT_HUNG, done.text()
    # The others' collective times out 20 s after they entered it, they watch the heartbeats for ~3 s (rank 1 is
    # silent) and end; the agent stops rank 1 (SIGTERM and SIGCONT from its lifeline): it runs again, dumps at its
    # watch's next tick (or as its next collective fails, whichever comes first) and ends there.
    assert seconds < timeout_s + 20, f"ended {seconds:.1f}s after the SIGSTOP\n{done.text()}"
    assert sorted(path.name for path in (run / "hang").iterdir()) == [f"rank_{r}.trace" for r in range(3)]
    *_, heartbeats, hang = done.stderr.strip().splitlines()
    assert "did not arrive: rank 1 (host " in heartbeats and f"pid {workers[1]}, after step 2;" in heartbeats, \
        done.text()
    assert "no heartbeat since" in heartbeats and heartbeats.endswith("[first failure]"), done.text()
    # Rank 1's collectives from once it ran again (its trace may list the one the others left) are named apart.
    named = re.fullmatch(r"distrib launch: hang: rank 1 did not enter all_reduce #(\d+) of the default group \(ranks "
                         r"0, 2 entered it; last common sequence (\d+)\); rank 1 did not run for [\d.]+ s "
                         r"\(stopped\)(?:; rank 1's trace, dumped once it ran again, also lists all_reduce #\1 of the "
                         r"default group(?: and \d+ more)?, which it entered then)?; "
                         rf"every rank's trace: {re.escape(str(run / 'hang'))}", hang)
    assert named and int(named[2]) == int(named[1]) - 1, done.text()
    # The order that bounds the run's end: the others dumped; rank 1, run again, dumped because they had (asked, or
    # its collective failed as they left) and ended there, with its own line, instead of waiting in the collective
    # they had left (up to dist.timeout_s where a peer's connection outlived it) and then blaming them.
    rank_1 = pickle.loads((run / "hang" / "rank_1.trace").read_bytes())["distrib"]
    assert rank_1["reason"] in ("asked", "lost") and rank_1["stopped_since_ns"] is not None, rank_1
    assert re.search(r"^distrib: error: rank 1 did not run for [\d.]+ s \(stopped: .* so it ends too", done.stderr,
                     re.M) and "lost rank" not in done.stderr, done.text()
    print(f"stopped rank named after {seconds:.1f}s: {hang}")


@pytest.mark.timeout(900)
def test_sigterm_while_a_rank_hangs_is_no_preemption(tmp_path):
    """A hung rank cannot checkpoint, so a preemption signal then must not answer 'requeue me' (75)."""
    cmd = distrib_cmd("train", "--nproc-per-node", "2", "--config", CLUSTER_CONFIG, *LONG,
                      "--set", "model.factory=tests.helpers.probe_env:hanging_network", "--set", "dist.timeout_s=3",
                      "--set", f"run.dir={tmp_path}/run")
    with Launches(tmp_path) as launches:
        launches.start(cmd, probe_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="12"))
        _wait_until(lambda: "probe: rank 1 hangs" in _stderr(launches, 0), EVENT_S, "a hung rank", launches)
        os.kill(_proc(launches).pid, signal.SIGTERM)
        [done] = launches.wait(timeout=EVENT_S)
    assert done.returncode == EXIT_HUNG, done.text()
    assert "distrib launch: stopped by SIGTERM" in done.stderr, done.text()
    assert "not every worker ended with 75, so this is no preemption exit; exit 69" in done.stderr, done.text()
    assert "did not arrive: rank 1 (host " in done.stderr, done.text()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_before_the_workers_exist_is_a_preemption(tmp_path, signum):
    with Launches(tmp_path) as launches:
        launches.start(distrib_cmd("launch", "--nproc-per-node", "2", PROBE, tmp_path, "sleep"))
        started = time.monotonic()
        # 0.5 s after the start, or once the interpreter has started (a loaded machine may take longer for that).
        _wait_until(lambda: _catches(_proc(launches).pid, signum), EVENT_S, "signal handler", launches)
        time.sleep(max(0.0, started + 0.5 - time.monotonic()))
        os.kill(_proc(launches).pid, signum)
        [done] = launches.wait(timeout=EVENT_S)
    assert done.returncode == EXIT_PREEMPTED, done.text()
    # The launcher's line, or the entry point's where the signal came while the CLI was still being imported.
    said = re.findall(rf"stopped by {signum.name} (?:before any worker started; exit 75|outside the training steps "
                      r".*exit code 75)", done.stderr)
    assert len(said) == 1, done.text()


def _torch_loaded(pid: int) -> bool:
    """Whether torch's C++ library is mapped into the process: it has begun to import torch."""
    with contextlib.suppress(OSError):
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    return False


def _stop_when(launches: Launches, ready, what: str) -> bool:
    """SIGTERM to the launcher as soon as ready() (polled every 5 ms: the moment is the test); the launcher is frozen
    (SIGSTOP) while the signal is sent, so what the test saw is the state the signal lands in. Returns whether the
    launcher had begun to import torch then."""
    proc = _proc(launches)
    wait_for(ready, EVENT_S, what, [proc], poll_s=0.005)
    os.kill(proc.pid, signal.SIGSTOP)
    loaded = _torch_loaded(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    return loaded


@pytest.mark.timeout(900)
def test_a_stop_signal_from_the_first_statement_is_a_preemption_and_the_rerun_trains(tmp_path):
    """SIGTERM to `distrib train --nproc-per-node 2` as soon as it catches SIGTERM (SigCgt: its first statement,
    before it imports anything), then as soon as both workers catch it and import torch: 75 each time, nothing
    written, and the same run then trains (`distrib train` in this process: nothing the stopped launches left in
    run.dir stands in its way). (A SLURM preemption in a job's first 2 s ended it with 143.)"""
    run = tmp_path / "run"
    cmd = distrib_cmd("train", "--nproc-per-node", "2", "--config", CLUSTER_CONFIG, *SMALL,
                      "--set", "train.max_steps=4", "--set", f"run.dir={run}")

    def workers_import_torch() -> bool:
        workers = _workers(_proc(launches).pid)
        return len(workers) == 2 and all(_catches(pid, signal.SIGTERM) and _torch_loaded(pid)
                                         for pid in workers.values())
    with Launches(tmp_path) as launches:
        launches.start(cmd)
        torch_loaded = _stop_when(launches, lambda: _catches(_proc(launches).pid, signal.SIGTERM), "handler")
        [done] = launches.wait(timeout=EVENT_S)
    # The handler came about 1 s before torch (on 2 busy cores); the one line is the entry point's.
    assert not torch_loaded, "SIGTERM was caught only once torch was importing: not from the first statement"
    assert done.returncode == EXIT_PREEMPTED, done.text()
    assert "distrib: stopped by SIGTERM outside the training steps" in done.stderr, done.text()
    (tmp_path / "workers").mkdir()
    with Launches(tmp_path / "workers") as launches:
        launches.start(cmd)
        _stop_when(launches, workers_import_torch, "2 workers importing torch")
        [done] = launches.wait(timeout=EVENT_S)
    assert done.returncode == EXIT_PREEMPTED, done.text()
    # The launcher says it once; its workers, whose stop it reports, stay quiet.
    assert "every worker ended with 75" in done.stderr and "outside the training steps" not in done.stderr, \
        done.text()
    assert not (run / "summary.json").exists()
    assert cli.main(["train", "--config", str(CLUSTER_CONFIG), *SMALL, "--set", "train.max_steps=4",
                     "--set", f"run.dir={run}"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


# A stop signal that lands where every exception is swallowed, as C code inside an import does (torch imports parts
# of numpy lazily, and a StoppedEarly raised there was lost: the worker went on and failed with exit 1).
_SWALLOWED = """
import os, signal, sys
from distrib.launch.preempt import exit_on_signals
with exit_on_signals([signal.SIGTERM]):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(1000))
    except BaseException:
        pass
    print("went on after the stop signal", flush=True)
sys.exit(3)
"""


@pytest.mark.timeout(900)
def test_a_stop_signal_while_a_worker_starts_ends_it_with_75_even_where_exceptions_are_swallowed(tmp_path):
    done = run_one([sys.executable, "-c", _SWALLOWED], tmp_path, timeout=EVENT_S)
    assert done.returncode == EXIT_PREEMPTED, done.text()
    assert "went on" not in done.stdout, done.text()
    assert "stopped by SIGTERM outside the training steps" in done.stderr and "exit code 75" in done.stderr, done.text()
