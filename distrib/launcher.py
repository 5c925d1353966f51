"""The parent process of `distrib launch` and `distrib train --nproc-per-node`: torchrun's own parser and elastic agent
(torch.distributed.run) with better defaults, SLURM detection, and one line per failed rank. The only writer of the
launch environment (torch's agent sets RANK and the rest for each worker; runtime.read_launch_env reads them)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Mapping, Sequence

from distrib.errors import EXIT_PREEMPTED, UserError

# Flags whose defaults we choose ourselves; None after parsing means neither the flag nor its PET_* form was given.
_OUR_DEFAULTS = ("nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id")
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 20000  # rendezvous port = base + job id % span: one per job, no clash
TORCHRUN_DEFAULTS = {"nnodes": "1:1", "rdzv_backend": "static", "rdzv_endpoint": "", "rdzv_id": "none"}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's own parser: every flag and PET_* variable (from os.environ) means what it means to torchrun."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "distrib launch"
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


def in_slurm(environ: Mapping[str, str]) -> bool:
    return all(key in environ for key in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NODELIST"))


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
    """Fills what the user left unset: nodes from SLURM, one worker per visible GPU, a private local rendezvous
    on a single node, and under SLURM a c10d rendezvous on the first node with the job id and a port from it."""
    slurm = in_slurm(environ)
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


def failure_lines(error) -> list[str]:
    """A ChildFailedError as one line per failed rank, the first failure first: which rank, how it ended, and its
    exception when the worker's entry point has @record (the traceback itself is in that worker's stderr)."""
    first, _ = error.get_first_failure()
    lines = []
    for rank in sorted(error.failures, key=lambda r: (r != first, r)):
        failure = error.failures[rank]
        if failure.exitcode < 0:
            how = f"was killed by signal {-failure.exitcode} ({failure.signal_name()})"
        else:
            how = f"exited with code {failure.exitcode}"
        message = failure.message
        if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {...}}
            text = str(message.get("message", "")).strip()
            how += f": {text.splitlines()[0][:600]}" if text else ""
        note = " [first failure]" if rank == first else ""
        lines.append(f"distrib launch: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}{note}")
    return lines


def signal_exit_code(signum: int) -> int:
    """SIGTERM is how schedulers stop a job before preemption or its time limit: EXIT_PREEMPTED, so the job script
    requeues it. Any other signal N: 128 + N, as a shell reports it."""
    return EXIT_PREEMPTED if signum == signal.SIGTERM else 128 + signum


def exit_code(error) -> int:
    """The first failure's exit code (so a worker's EXIT_PREEMPTED reaches the job script), or its signal's."""
    _, failure = error.get_first_failure()
    return failure.exitcode if failure.exitcode > 0 else signal_exit_code(-failure.exitcode)


def run(args: argparse.Namespace) -> int:
    """torch.distributed.run.run, its failures turned into messages and exit codes instead of tracebacks."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        torchrun.run(args)
    except ChildFailedError as e:
        print("\n".join(failure_lines(e)), file=sys.stderr, flush=True)
        return exit_code(e)
    except SignalException as e:
        # The agent has already passed the signal on to the workers and waited for them.
        code = signal_exit_code(int(e.sigval))
        print(f"distrib launch: stopped by {e.sigval.name}; the workers were stopped too (exit {code})",
              file=sys.stderr)
        return code
    except RendezvousError as e:
        raise UserError(f"rendezvous {args.rdzv_backend} at {args.rdzv_endpoint!r} (id {args.rdzv_id}) failed: "
                        f"{e}; check that every node runs the same --nnodes, --rdzv-endpoint and --rdzv-id") from None
    return 0


def main(argv: Sequence[str]) -> int:
    """`distrib launch [torchrun options] SCRIPT|-m MODULE [args]`; returns the exit code."""
    args = apply_defaults(parse_args(argv), os.environ)
    threads = cpu_threads(os.environ, local_world_size(args.nproc_per_node), visible_gpu_count())
    if threads is not None:
        # Set here, in the one writer of the launch environment; torch's agent passes it on to every worker.
        os.environ["OMP_NUM_THREADS"] = threads
    return run(args)


def launch_trainer(nproc_per_node: int, train_argv: Sequence[str]) -> int:
    """`distrib train --nproc-per-node N ...`: N workers of `python -m distrib train ...` on this node."""
    return main(["--nproc-per-node", str(nproc_per_node), "-m", "distrib", "train", *train_argv])
