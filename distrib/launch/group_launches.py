"""The run of `distrib launch --replica-groups G` on one node: torchft's Lighthouse and G ordinary launches of W/G
workers, each restarted on its own, as one run: a stop signal goes on to every group, a group's failure stops the
others, and one exit code and last line say how the groups ended. The group flags and checks: replica_groups."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from distrib.errors import EXIT_PREEMPTED, UserError, say
from distrib.launch.lifeline import child_setup
from distrib.launch.lighthouse import start_lighthouse

FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # passed on to every group's launcher
LIGHTHOUSE = "the Lighthouse"  # how the run's last line names it among the groups
LIGHTHOUSE_RESTARTS = 3  # a Lighthouse this launch started is started again when it ends, this many times


def group_argv(argv: Sequence[str], args: argparse.Namespace, group: int, per_group: int, lighthouse: str) -> list[str]:
    """The `distrib launch` arguments of replica group `group`: the user's, with its share of the workers, its index,
    the Lighthouse and a role named after it (torch's agent logs restarts as "[ROLE] Worker group FAILED"). Later
    flags win in argparse, so they go right before the script (also the user's abbreviations and PET_* lose)."""
    script_at = len(argv) - 1 - len(args.training_script_args)
    return [*argv[:script_at], "--nproc-per-node", str(per_group), "--replica-group", str(group),
            "--lighthouse", lighthouse, "--role", f"replica_group_{group}", *argv[script_at:]]


def group_env(environ: Mapping[str, str], group: int, per_group: int, num_gpus: int) -> dict[str, str]:
    """Replica group `group`'s own GPUs: its slice of the visible ones (each group's local ranks start at 0)."""
    if not num_gpus:
        return {}
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(index) for index in range(num_gpus)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(devices[group * per_group:(group + 1) * per_group])}


def shell_code(returncode: int) -> int:
    """A child's exit as a shell reports it: 128 + N for signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def combined_exit_code(codes: Sequence[int]) -> int:
    """The run's exit code from its groups' (in the order they ended): the first failure's (the cause; the others were
    stopped because of it), else EXIT_PREEMPTED when a group was preempted (the job script requeues), else 0."""
    failed = [code for code in codes if code not in (0, EXIT_PREEMPTED)]
    if failed:
        return failed[0]
    return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0


class ReplicaGroups:
    """The launches of the groups and the Lighthouse, as one run: a stop signal goes on to every group; a group that
    ends with an error (its restarts spent) ends the run, the others stopped as a preemption stops them."""

    def __init__(self, lighthouse: subprocess.Popen | None, restart_lighthouse=None):
        self.lighthouse, self.groups = lighthouse, []
        self.restart_lighthouse = restart_lighthouse  # () -> a new Lighthouse at the same address; None: none
        self.lighthouse_restarts = 0
        self.relays: list[threading.Thread] = []  # the threads that pass the groups' lines on, prefixed
        self.stop_signal: int | None = None  # set by the handler: the run was asked to stop
        self.stopping = False  # the other groups were told to stop, after a failure
        self.lost = False  # the Lighthouse ended while groups ran

    def start(self, cmd: list[str], env: Mapping[str, str]) -> None:
        """Replica group len(groups): its launch, each line it prints prefixed with "[group g] " (the groups' lines
        are alike, and they come out interleaved)."""
        proc = subprocess.Popen(cmd, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=child_setup(os.getpid()))
        prefix = f"[group {len(self.groups)}] ".encode()
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            self.relays.append(threading.Thread(target=_prefixed, args=(stream, out, prefix), daemon=True))
            self.relays[-1].start()
        self.groups.append(proc)

    def forward(self, signum, frame=None) -> None:
        """The signal handler: passes the signal on to every group's launcher (they to their workers)."""
        self.stop_signal = self.stop_signal or signum
        self._signal_all(signum)

    def _signal_all(self, signum: int) -> None:
        for proc in self.groups:
            proc.send_signal(signum)  # none to one that ended (Popen checks)

    def _stop_after(self, why: str) -> None:
        if self.stop_signal is None and not self.stopping:
            say(f"distrib launch: {why}; stopping the other replica groups (SIGTERM: they checkpoint and stop)")
            self.stopping = True
            self._signal_all(signal.SIGTERM)

    def wait(self, poll_s: float = 0.1) -> list[tuple[str, int]]:
        """(who, exit code: 128 + N for signal N) of each group, and of a Lighthouse that ended before them, in the
        order they ended."""
        ended, running = [], dict(enumerate(self.groups))
        while running:
            for index, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[index]
                    ended.append((f"group {index}", shell_code(proc.returncode)))
                    if ended[-1][1] != 0 and not self.lost:  # without a Lighthouse each group stops on its own
                        self._stop_after(f"replica group {index} ended with exit {ended[-1][1]} (its --max-restarts "
                                         "spent, or stopped)")
            if running and self.lighthouse is not None and self.lighthouse.poll() is not None and not self.lost:
                if self._restarted_lighthouse():
                    continue
                self.lost = True
                ended.append((LIGHTHOUSE, shell_code(self.lighthouse.returncode) or 1))
                # Not a signal: a group inside torchft's quorum could not act on it before the agent's grace ran
                # out. Each group's quorum fails on its own (dist.timeout_s); the group then checkpoints and exits 75.
                say(f"distrib launch: torchft's Lighthouse ended (exit {ended[-1][1]}): no step can be agreed without "
                    "it; each replica group checkpoints and stops (exit 75) once its quorum gives up (dist.timeout_s)"
                    "; run the same command again to resume")
            if running:
                time.sleep(poll_s)
        return ended

    def _restarted_lighthouse(self) -> bool:
        """A Lighthouse that ended started again at its address (LIGHTHOUSE_RESTARTS times at most). torchft cannot
        take a quorum in flight over to it: each group's quorum gives up (dist.timeout_s), the group checkpoints and
        ends 75, and its launcher restarts it (--max-restarts) from that checkpoint, at the new Lighthouse."""
        if self.restart_lighthouse is None or self.lighthouse_restarts >= LIGHTHOUSE_RESTARTS:
            return False
        code = shell_code(self.lighthouse.returncode)
        try:
            self.lighthouse = self.restart_lighthouse()
        except UserError as e:
            say(f"distrib launch: torchft's Lighthouse ended (exit {code}) and did not start again: {e}")
            return False
        self.lighthouse_restarts += 1
        say(f"distrib launch: torchft's Lighthouse ended (exit {code}); started it again at the same address "
            f"({self.lighthouse_restarts} of {LIGHTHOUSE_RESTARTS}): each replica group's quorum in flight gives up "
            "(dist.timeout_s), then the group checkpoints, ends 75 and is restarted from there (--max-restarts)")
        return True

    def close(self) -> None:
        """Ends what is still running (the Lighthouse, or every group when this launcher is leaving early)."""
        for proc in [*self.groups, *([self.lighthouse] if self.lighthouse else [])]:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        for relay in self.relays:  # the groups' last lines (their pipes end with them)
            relay.join(timeout=5.0)


def _prefixed(stream, out, prefix: bytes) -> None:
    """Passes a group's output on, line by line, each line prefixed."""
    with stream:
        for line in iter(stream.readline, b""):
            out.buffer.write(prefix + line)
            out.flush()


def run_groups(args: argparse.Namespace, argv: Sequence[str], num_workers: int, num_gpus: int) -> int:
    """The Lighthouse (unless --lighthouse names one) and args.replica_groups launches of this node's workers, each
    `distrib launch` with its own rendezvous, restarts and reports; returns the run's exit code once all ended."""
    from distrib.launch.preempt import signal_handlers

    num_groups = args.replica_groups
    per_group = num_workers // num_groups
    log = Path(args.lighthouse_log or Path(tempfile.mkdtemp(prefix="distrib-lighthouse-")) / "lighthouse.log")
    lighthouse, address = (None, args.lighthouse) if args.lighthouse else start_lighthouse(args.min_replicas, log)
    port = int(address.rpartition(":")[2]) if lighthouse else 0
    run = ReplicaGroups(lighthouse, (lambda: start_lighthouse(args.min_replicas, log, port)[0]) if port else None)
    try:
        with signal_handlers(FORWARDED, run.forward):
            say(f"distrib launch: {num_groups} replica groups of {per_group} workers, torchft's Lighthouse at "
                f"{address}" + (f" (min_replicas {args.min_replicas}; its log: {log})"
                                if lighthouse else ""))
            for group in range(num_groups):
                if run.stop_signal is None:
                    run.start([sys.executable, "-m", "distrib", "launch",
                               *group_argv(argv, args, group, per_group, address)],
                              {**os.environ, **group_env(os.environ, group, per_group, num_gpus)})
            ended = run.wait()
    finally:
        run.close()
    code = run_exit_code(run.stop_signal, ended)
    if not args.lighthouse_log and (code == 0 or lighthouse is None):  # a failed run's stays, named in the last line
        shutil.rmtree(log.parent, ignore_errors=True)
    if code != 0:
        say(end_line(run.stop_signal, ended, code, log if lighthouse else None))
    return code


def run_exit_code(stop_signal: int | None, ended: Sequence[tuple[str, int]]) -> int:
    """The run's exit code from how its parts ended: the groups' codes (combined_exit_code). A lost Lighthouse is in
    the last line, not the code: the groups it left without quorums checkpointed and ended 75, which resumes."""
    if stop_signal and not ended:
        return EXIT_PREEMPTED
    return combined_exit_code([code for who, code in ended if who != LIGHTHOUSE])


def end_line(stop_signal: int | None, ended: Sequence[tuple[str, int]], code: int, log: Path | None) -> str:
    """The parent's last line when the run did not simply finish: how each group ended, in order, and the code."""
    how = (f"stopped by {signal.Signals(stop_signal).name}, passed on to every replica group" if stop_signal
           else "the run of replica groups ended")
    order = ", ".join(f"{who} exit {code}" for who, code in ended) or "no group had started"
    log = f"; the Lighthouse's log: {log}" if log else ""
    return f"distrib launch: {how} (in the order they ended: {order}){log}; exit {code}"
