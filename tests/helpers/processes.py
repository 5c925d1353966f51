"""The tests' one subprocess runner: commands started in sessions of their own, output to files (no pipe can fill and
block), and on timeout or failure every process tree killed, also the workers that torch's elastic agent starts in
sessions of their own. `run` is one command of it; `Launches` several at once."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("PET_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "MASTER_",
               "TORCHELASTIC_", "SLURM_", "SKYPILOT_", "OMP_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launch, SLURM or PET_* variables (CI may run inside a job), plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this python's `distrib`
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _started(pid: int) -> str | None:
    """pid's start time (field 22 of /proc/PID/stat), None once it has ended: with the pid, it names one process."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    return None


def own_processes() -> dict[int, str]:
    """Every process this one started, at any depth, by pid, with its start time (for kill_remaining)."""
    return {pid: started for pid in descendants(os.getpid()) if (started := _started(pid))}


def kill_remaining(processes: dict[int, str]) -> list[int]:
    """SIGKILLs those of `processes` (from own_processes) still running, also those since re-parented to init (the
    same pid with the same start time, so a new process that took a freed pid is spared), and reaps its own children.
    Returns the pids killed."""
    killed = []
    for pid, started in processes.items():
        if _started(pid) == started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    for pid in killed:  # reaped, where this process is the parent: a zombie outlives it where init reaps none
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return killed


def _listening_sockets() -> dict[str, tuple[str, int]]:
    """Every TCP socket in LISTEN state on this machine, by inode: (address, port), from /proc/net/tcp and tcp6."""
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with contextlib.suppress(OSError):
            for line in Path("/proc/net", table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def listening_addresses(pid: int) -> dict[int, list[tuple[str, int]]]:
    """The (address, port) pairs that process pid and its descendants listen on, by pid."""
    sockets, found = _listening_sockets(), {}
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{each}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in sockets:
                        found.setdefault(each, []).append(sockets[target[8:-1]])
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a running process, its group and every descendant, also those in sessions of their own (torch's
    elastic agent starts each worker in a new session, so killing the launcher's group alone leaves them)."""
    if proc.poll() is not None:
        return  # ended: its pid may belong to someone else by now
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGSTOP)  # no new children while we look for them
    pids = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def worker_pid(marker: str, local_rank: int) -> int | None:
    """The training worker whose command line holds `marker` and whose LOCAL_RANK is `local_rank` (not its lifeline,
    whose command line holds the worker's)."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker in cmdline and "distrib.launch.lifeline" not in cmdline \
                and f"LOCAL_RANK={local_rank}".encode() in environ:
            return int(entry.name)
    return None


# How long a test waits for an event (a file, a log line, a worker) on a loaded machine: a checkpoint that takes 12 s
# on a quiet one took over 120 s beside a busy disk. Waits end as soon as the event comes, so only failures pay it.
EVENT_S = 420.0


def wait_for(predicate, timeout: float, what: str, procs: Sequence[subprocess.Popen] = (), poll_s: float = 0.05):
    """predicate()'s first truthy value, polled every poll_s. Fails the test after timeout seconds, or as soon as one
    of procs has ended: then the event will not come, and waiting out the deadline would only hide why."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        ended = [f"{' '.join(map(str, p.args))[:200]} (exit {p.returncode})" for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            why = f"it ended first: {'; '.join(ended)}" if ended else f"timed out after {timeout:.0f}s"
            raise AssertionError(f"no {what}: {why}")
        time.sleep(poll_s)


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def text(self) -> str:
        return f"exit {self.returncode} after {self.seconds:.1f}s\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"


class Launches:
    """Starts commands at once, output to files; kills every tree on exit. `env` replaces the environment; the
    default is clean_env()."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = Path(log_dir), []

    def start(self, cmd: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> int:
        name = self.log_dir / f"proc{len(self.procs)}"
        out, err = open(f"{name}.out", "w"), open(f"{name}.err", "w")
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env or clean_env(), cwd=cwd, text=True,
                                start_new_session=True)
        self.procs.append((proc, name, time.monotonic()))
        return len(self.procs) - 1

    def wait(self, timeout: float) -> list[Done]:
        """Waits for all; on timeout kills them all and fails the test with their output."""
        deadline, results = time.monotonic() + timeout, []
        for proc, name, started in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
                raise AssertionError(f"timed out after {timeout}s: {' '.join(map(str, proc.args))}\n"
                                     f"{Path(f'{name}.out').read_text()[-3000:]}\n"
                                     f"{Path(f'{name}.err').read_text()[-6000:]}") from None
            results.append(Done(proc.returncode, Path(f"{name}.out").read_text(), Path(f"{name}.err").read_text(),
                                time.monotonic() - started))
        return results

    def close(self) -> None:
        for proc, _, _ in self.procs:
            kill_tree(proc)

    def __enter__(self) -> "Launches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_one(cmd: list[str], log_dir: Path, timeout: float, env: dict[str, str] | None = None) -> Done:
    with Launches(log_dir) as launches:
        launches.start(cmd, env)
        return launches.wait(timeout)[0]


def run(cmd: list[str], timeout: float, env: dict | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    """One command in clean_env() plus `env`; on timeout its whole process tree is killed and the test fails with
    its output."""
    with tempfile.TemporaryDirectory(prefix="distrib-test-") as logs, Launches(Path(logs)) as launches:
        launches.start(cmd, clean_env(**(env or {})), cwd or REPO)
        done = launches.wait(timeout)[0]
    return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stderr)
