"""The parent process of `distrib launch` and `distrib train --nproc-per-node`: torchrun's own parser and elastic agent
(torch.distributed.run) with better defaults, SLURM and SkyPilot detection (clusters), and one line per failed rank.
The only writer of the launch environment (torch's agent sets RANK and the rest for each worker;
runtime.read_launch_env reads them)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from distrib.errors import EXIT_PREEMPTED, UserError, say
from distrib.launch import clusters, replica_groups
from distrib.launch.allocator import worker_preload
from distrib.launch.clusters import in_skypilot, in_slurm
from distrib.launch.reporting import (
    REPORTS_VAR,
    cause_of,
    failure_lines,
    hang_line,
    quiet_torch_failure_lines,
    restart_line,
)
from distrib.launch_env import HANG_NOTE_VAR

# Flags whose defaults we choose ourselves; None after parsing means neither the flag nor its PET_* form was given.
_OUR_DEFAULTS = ("nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "node_rank", "master_addr")
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000  # rendezvous port = base + job id % span: one per job, no clash
TORCHRUN_DEFAULTS = {"nnodes": "1:1", "rdzv_backend": "static", "rdzv_endpoint": "", "rdzv_id": "none",
                     "node_rank": 0, "master_addr": "127.0.0.1"}


def usage_error(prog: str, message: str) -> UserError:
    """argparse's error as one line (exit 2) that names the flag, the value and the fix, instead of its usage text and
    the message (7 to 25 lines)."""
    bad = re.match(r"argument ([^/:]+)[^:]*: invalid (int|float) value: (.*)", message)
    if bad:
        flag, kind, value = bad.groups()
        return UserError(f"{prog} {flag} {value}: not a {'whole ' if kind == 'int' else ''}number; give one, e.g. "
                         f"{flag} 2 (see {prog} --help)")
    return UserError(f"{prog}: {message}; see {prog} --help")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's own parser: every flag and PET_* variable (from os.environ) means what it means to torchrun; and
    distrib launch's own replica-group flags (replica_groups.add_flags)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "distrib launch"
    replica_groups.add_flags(parser)

    def error(message: str):
        raise usage_error(parser.prog, message)

    parser.error = error
    parser.set_defaults(**{dest: None for dest in _OUR_DEFAULTS if f"PET_{dest.upper()}" not in os.environ})
    return parser.parse_args(list(argv))


def slurm_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames`, the one expansion of SLURM's compressed node lists that is always right."""
    fix = "put SLURM's scontrol on PATH (apt-get install slurm-client or module load slurm), or give --rdzv-endpoint"
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=60)
    except FileNotFoundError:
        raise UserError(f"SLURM_JOB_NODELIST={nodelist!r} but scontrol is not on PATH, so the first node is "
                        f"unknown; {fix}") from None
    hosts = done.stdout.split()
    if done.returncode or not hosts:
        raise UserError(f"scontrol show hostnames {nodelist!r} failed ({done.stderr.strip() or 'no hosts'}); {fix}")
    return hosts


def slurm_rendezvous_port(job_id: str) -> int:
    try:
        return SLURM_PORT_BASE + int(job_id) % SLURM_PORT_SPAN
    except ValueError:
        raise UserError(f"SLURM_JOB_ID={job_id!r} is not a number; give --rdzv-endpoint HOST:PORT") from None


def check_slurm_step(environ: Mapping[str, str]) -> None:
    """One distrib launch per node, started by srun: any other count waits for nodes that never join."""
    if "SLURM_STEP_ID" not in environ:
        raise UserError(f"SLURM_NNODES={environ['SLURM_NNODES']} but this is the batch script, not a job step, so "
                        "only one node would join; run it as srun --ntasks-per-node=1 distrib launch ... "
                        "(see scripts/slurm/train.sbatch), or give --nnodes")
    tasks, nodes = environ.get("SLURM_STEP_NUM_TASKS"), environ.get("SLURM_STEP_NUM_NODES")
    if tasks and nodes and tasks != nodes:
        raise UserError(f"srun started {tasks} tasks on {nodes} nodes but distrib launch wants one task per node "
                        "(it starts the workers itself); use srun --ntasks-per-node=1 as scripts/slurm/train.sbatch "
                        "does")


def apply_defaults(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """Fills what the user left unset: nodes from SLURM or SkyPilot, one worker per visible GPU, a private local
    rendezvous on a single node, under SLURM a c10d rendezvous on the first node with the job id and a port from it,
    under SkyPilot torchrun's static one on the head node (clusters.PRECEDENCE: flags > PET_* > SLURM/SkyPilot)."""
    clusters.check_agreement(args.nnodes, environ)
    slurm = in_slurm(environ)
    if not slurm and in_skypilot(environ):
        skypilot_defaults(args, environ)
    if args.nnodes is None and slurm and _max_nodes(environ["SLURM_NNODES"], "SLURM_NNODES") > 1:
        check_slurm_step(environ)
        args.nnodes = environ["SLURM_NNODES"]
    args.nnodes = args.nnodes or TORCHRUN_DEFAULTS["nnodes"]
    if args.nproc_per_node is None:
        args.nproc_per_node = str(max(visible_gpu_count(), 1))
    max_nodes = _max_nodes(args.nnodes)
    if max_nodes == 1 and not args.rdzv_endpoint and args.master_port is None:
        # torchrun's --standalone: a c10d store on a free port, so two runs on one machine never clash.
        args.standalone = True
    elif slurm and not args.standalone and args.rdzv_backend in (None, "c10d"):
        job_id = environ["SLURM_JOB_ID"]
        if args.rdzv_endpoint is None:
            head = slurm_hostnames(environ["SLURM_JOB_NODELIST"])[0]
            args.rdzv_endpoint = f"{head}:{slurm_rendezvous_port(job_id)}"
        args.rdzv_backend = args.rdzv_backend or "c10d"
        args.rdzv_id = args.rdzv_id or job_id
    for dest, default in TORCHRUN_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    return args


def skypilot_defaults(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """SkyPilot's nodes, GPUs and head where no flag or PET_* gave them: as its torchrun recipe, a static rendezvous
    on the head's IP (the first of SKYPILOT_NODE_IPS) at a fixed port, this node's rank SKYPILOT_NODE_RANK."""
    head, node_rank, num_nodes = clusters.skypilot_nodes(environ)
    args.nnodes = args.nnodes or num_nodes
    gpus = environ.get("SKYPILOT_NUM_GPUS_PER_NODE", "0")
    if args.nproc_per_node is None and gpus not in ("", "0"):
        args.nproc_per_node = gpus  # on CPU nodes: the default below (one per visible GPU, else 1)
    if _max_nodes(args.nnodes, "SKYPILOT_NUM_NODES") > 1 and not args.rdzv_endpoint \
            and args.rdzv_backend in (None, "static"):
        args.master_addr = args.master_addr or head
        args.master_port = args.master_port or clusters.SKYPILOT_PORT
        if args.node_rank is None:
            args.node_rank = _whole(node_rank, "SKYPILOT_NODE_RANK")


def _whole(text: str, source: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{source}={text!r} is not a whole number; give --node-rank N") from None


def check_rendezvous(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """A multi-node launch's node rank is in range and its rendezvous host resolves: one line each, naming where the
    value came from, instead of nodes that wait forever or the agent's traceback."""
    max_nodes = _max_nodes(args.nnodes)
    if max_nodes == 1 or args.standalone or args.rdzv_backend not in ("static", "c10d"):
        return

    def source(flag: str, *keys: str) -> str:
        value = str(getattr(args, flag[2:].replace("-", "_")))
        return next((key for key in keys if environ.get(key, "").split()[:1] == [value]), flag)
    if args.rdzv_backend == "static":
        clusters.check_node_rank(args.node_rank, max_nodes, source("--node-rank", "PET_NODE_RANK",
                                                                   "SKYPILOT_NODE_RANK"))
        clusters.check_resolves(args.master_addr, source("--master-addr", "PET_MASTER_ADDR", "SKYPILOT_NODE_IPS")
                                + f"={args.master_addr}")
    else:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        endpoint = args.rdzv_endpoint
        host, _ = parse_rendezvous_endpoint(endpoint, default_port=29400)
        name = "PET_RDZV_ENDPOINT" if environ.get("PET_RDZV_ENDPOINT") == endpoint else "--rdzv-endpoint"
        clusters.check_resolves(host, f"{name}={endpoint}")


def _max_nodes(nnodes: str, source: str = "--nnodes") -> int:
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        raise UserError(f"{source}={nnodes!r}: expected N or MIN:MAX, e.g. --nnodes 2") from None


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_world_size(nproc_per_node: str) -> int:
    from torch.distributed.run import determine_local_world_size

    try:
        return determine_local_world_size(nproc_per_node)
    except ValueError as e:
        raise UserError(f"--nproc-per-node {nproc_per_node!r}: {e}; give a number, or auto, cpu or gpu") from None


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


# Signals that ask a run to stop for preemption: SLURM's --signal and scancel, Kubernetes and most schedulers.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def signal_exit_code(signum: int, codes: Sequence[int | None] = ()) -> int:
    """The exit code after signal signum reached the launcher, from the exit codes of this attempt's workers (from
    their lifelines; None: killed with it): EXIT_PREEMPTED for SIGTERM/SIGUSR1 when no worker had started (nothing
    is lost) or when the workers ended with EXIT_PREEMPTED (their checkpoint is committed), so the job script
    requeues; otherwise a worker's own failure code (e.g. EXIT_HUNG), or 128 + N as a shell reports signal N."""
    if signum in STOP_SIGNALS:
        if not codes or (all(c in (0, EXIT_PREEMPTED) for c in codes) and EXIT_PREEMPTED in codes):
            return EXIT_PREEMPTED
        if all(c == 0 for c in codes):
            return 0
    failed = [c for c in codes if c is not None and c > 0 and c != EXIT_PREEMPTED]
    return failed[0] if failed else 128 + signum


def _stopped_line(signum: int, codes: Sequence[int | None], code: int) -> str:
    name = signal.Signals(signum).name
    if not codes:
        return f"distrib launch: stopped by {name} before any worker started; exit {code}" + (
            ": requeue the job and it starts (or resumes) there" if code == EXIT_PREEMPTED else "")
    ended = ", ".join("running (killed)" if c is None else f"killed by signal {-c}" if c < 0 else f"exit {c}"
                      for c in codes)
    verdict = ("every worker ended with 75 (checkpointed, or nothing to lose): requeue the job and it resumes there"
               if code == EXIT_PREEMPTED
               else "the workers had finished" if code == 0
               else "not every worker ended with 75, so this is no preemption exit")
    return f"distrib launch: stopped by {name}; the workers were stopped too ({ended}); {verdict}; exit {code}"


def _exit_before_start(signum, frame) -> None:
    """A stop signal before any worker or store exists: nothing to stop or lose, so the launcher ends at once. Not by
    raising: an exception raised inside an import (torch, numpy) can leave a module half-initialised and end the
    launcher with an ImportError instead."""
    code = signal_exit_code(signum)
    say(_stopped_line(signum, [], code))
    os._exit(code)


@contextlib.contextmanager
def stop_handlers(raise_for=None) -> Iterator[None]:
    """SIGTERM and SIGUSR1 raise raise_for(signum) in the main thread while inside (without raise_for: end the
    launcher at once); the old handlers come back. torch's agent installs its own SIGTERM handler (raising
    SignalException) once it starts workers."""
    def raising(signum, frame):
        raise raise_for(signum)
    from distrib.launch.preempt import signal_handlers

    with signal_handlers(STOP_SIGNALS, raising if raise_for else _exit_before_start):
        yield


def exit_code(error) -> int:
    """The failing rank's exit code (reporting.cause_of), or 128 + N for the signal N that killed it (a worker killed
    by SIGTERM did not checkpoint: no preemption exit); EXIT_PREEMPTED when no rank failed, only preempted, so that
    the job script requeues."""
    cause = cause_of(error)
    if cause is None:
        return EXIT_PREEMPTED
    code = error.failures[cause].exitcode
    return code if code > 0 else 128 - code


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


def run_agent(args: argparse.Namespace) -> int:
    """torch.distributed.run.run, each worker under a lifeline, its failures turned into messages and exit codes
    instead of tracebacks."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from distrib.launch import rendezvous
    from distrib.launch.lifeline import read_attempt, read_statuses

    def signal_exception(signum: int) -> SignalException:  # what torch's own handler raises
        return SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    def restarting() -> None:  # torch's agent stopped a failed attempt's workers: say who failed it, if it restarts
        with contextlib.suppress(Exception):  # called inside torch's logging call: never break the agent's restart
            line = restart_line(*read_attempt(status), args.max_restarts)
            if line:
                say(replica_groups.tagged(args, line))

    started_ns = time.time_ns()
    with lifelines(args) as status, stop_handlers(signal_exception), quiet_torch_failure_lines(restarting), \
            rendezvous.registered():
        try:
            torchrun.run(rendezvous.private_args(args))
        except SignalException as e:
            # The agent has already passed the signal on to the workers and waited for them.
            codes = [worker.code for worker in read_statuses(status)]
            code = signal_exit_code(int(e.sigval), codes)
            say(replica_groups.tagged(args, _stopped_line(int(e.sigval), codes, code)))
            return code
        except ChildFailedError as e:
            workers = read_statuses(status)  # a lifeline torch's agent SIGKILLed after its grace left no code
            lines = failure_lines(e, {worker.pid: worker.worker_pid for worker in workers},
                                  {worker.pid for worker in workers if worker.code is None})
            hang = hang_line(status.parent / "hang_note", started_ns, fixed_world_size(args))  # where ranks diverged
            say(replica_groups.tagged(args, "\n".join(lines + ([hang] if hang else []))))
            return exit_code(e)
        except RendezvousError as e:
            raise UserError(f"rendezvous {args.rdzv_backend} at {args.rdzv_endpoint!r} (id {args.rdzv_id}) failed: "
                            f"{e}; check that every node runs the same --nnodes, --rdzv-endpoint and --rdzv-id") \
                from None
        except (DistStoreError, DistNetworkError) as e:
            if args.rdzv_backend != "static":
                raise
            # torchrun's static rendezvous (PET_* from a TrainJob, SkyPilot): node 0's store waits for every node.
            raise UserError(f"rendezvous at {args.master_addr}:{args.master_port}: not all {args.nnodes} nodes "
                            f"(--nnodes, PET_NNODES) arrived as node {args.node_rank} waited "
                            f"({str(e).splitlines()[0]}); every node needs the same node count, a node rank below "
                            "it, and node 0 up") from None
    return 0


def check_program(args: argparse.Namespace) -> None:
    """The script (or --no-python program) exists: said once here, not once per worker. A -m module is looked up by
    the workers (finding it here would import its packages)."""
    name = args.training_script
    if args.module:
        return
    if args.no_python:
        if shutil.which(name) is None:
            raise UserError(f"{name}: no such program on PATH (--no-python runs it as a command); give its path")
        return
    if not Path(name).is_file():
        raise UserError(f"{name}: no such script; give the path of a Python script, or -m MODULE "
                        "(e.g. distrib launch --nproc-per-node 2 -m distrib train)")


def fixed_world_size(args: argparse.Namespace) -> int | None:
    """nnodes x workers per node, when the node count is fixed (not MIN:MAX with MIN < MAX)."""
    low, _, high = args.nnodes.partition(":")
    if high and low != high:
        return None
    return _max_nodes(args.nnodes) * local_world_size(args.nproc_per_node)


@contextlib.contextmanager
def _reporting_env() -> Iterator[None]:
    previous = os.environ.get(REPORTS_VAR)
    os.environ[REPORTS_VAR] = "1"  # the one writer of the launch environment; torch's agent passes it on
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(REPORTS_VAR, None)
        else:
            os.environ[REPORTS_VAR] = previous


def main(argv: Sequence[str], check: Callable[[int, int | None], None] | None = None) -> int:
    """`distrib launch [torchrun options] SCRIPT|-m MODULE [args]`; returns the exit code. A stop signal from the
    first moment on ends it with the preemption code (the job is requeued), also before torch is imported.
    check(workers on this node, world_size) runs before any worker starts (world_size None when the node count is
    elastic). With --replica-groups G > 1 this node's workers run as G replica groups (replica_groups.run_groups)."""
    with stop_handlers():
        args = apply_defaults(parse_args(argv), os.environ)
        check_rendezvous(args, os.environ)
        check_program(args)
        num_gpus, num_workers = visible_gpu_count(), local_world_size(args.nproc_per_node)
        replica_groups.settle(args, num_workers, os.environ)
        if check is not None:  # a replica group is a world of its own: its layout is checked at its size
            check(num_workers, num_workers // args.replica_groups if replica_groups.starts_groups(args)
                  else fixed_world_size(args))
        warning = oversubscribed(num_workers, num_gpus)
        if warning:
            say(warning)
        threads = cpu_threads(os.environ, num_workers, num_gpus)
        if threads is not None:
            # Set here, in the one writer of the launch environment; torch's agent passes it on to every worker.
            os.environ["OMP_NUM_THREADS"] = threads
        os.environ.update(worker_preload(os.environ, num_gpus))  # the workers' host allocator: tcmalloc if installed
        os.environ.update(private_sockets(os.environ, _max_nodes(args.nnodes)))
        if replica_groups.starts_groups(args):  # each group's launch sets the rest of its workers' environment
            return replica_groups.run_groups(args, argv, num_workers, num_gpus)
        os.environ.update(replica_groups.worker_env(args))  # this launch is one group: DISTRIB_REPLICA_GROUP, ...
        with _reporting_env():
            return run_agent(args)


# The flags of distrib launch that distrib train takes too (True: the flag takes a value). distrib train hands them
# to main as given, where torch's own parser reads them (types, PET_* variables, defaults): each means exactly what
# it means to distrib launch and torchrun.
TRAIN_FLAGS = {"--nproc-per-node": True, "--nnodes": True, "--max-restarts": True, "--standalone": False,
               "--rdzv-backend": True, "--rdzv-endpoint": True, "--rdzv-id": True, "--rdzv-conf": True,
               "--node-rank": True, "--master-addr": True, "--master-port": True}


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """TRAIN_FLAGS on distrib train's parser, kept as text (parsing them imports no torch: a stop signal while
    `distrib train` starts still ends it with 75)."""
    group = parser.add_argument_group("launching (as for distrib launch; any of them starts the workers through it)")
    for flag, takes_value in TRAIN_FLAGS.items():
        if flag != "--nproc-per-node":  # distrib train's own: checked there, and shared with eval and predict
            group.add_argument(flag, **({"metavar": "VALUE"} if takes_value else {"action": "store_true"}),
                               help=f"as {flag} of distrib launch (torchrun)")


def train_flags(args: argparse.Namespace) -> list[str]:
    """The TRAIN_FLAGS that distrib train was given, as distrib launch's arguments."""
    given = []
    for flag, takes_value in TRAIN_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, False):
            given += [flag, str(value)] if takes_value else [flag]
    return given


def without_train_flags(argv: Sequence[str]) -> list[str]:
    """The command line a launched worker runs: the user's, less the TRAIN_FLAGS (--flag VALUE or --flag=VALUE)."""
    out, skip = [], False
    for item in argv:
        name, equals, _ = item.partition("=")
        if skip:
            skip = False
        elif name in TRAIN_FLAGS:
            skip = TRAIN_FLAGS[name] and not equals
        else:
            out.append(item)
    return out


def launch_trainer(launch_flags: Sequence[str], train_argv: Sequence[str],
                   check: Callable[[int, int | None], None] | None = None) -> int:
    """`distrib train --nproc-per-node N ...` (or any TRAIN_FLAGS): workers of `python -m distrib train ...` started
    as `distrib launch FLAGS -m distrib train ...` starts them; check as in main."""
    return main([*launch_flags, "-m", "distrib", "train", *train_argv], check)
