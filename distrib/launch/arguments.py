"""distrib launch's command line: torchrun's own parser and flags, the defaults we choose in their place (SLURM,
SkyPilot, one worker per visible GPU, a private rendezvous on one node), and the checks of the rendezvous and the
script that run once, before any worker starts."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from distrib.errors import UserError
from distrib.launch import clusters, replica_groups
from distrib.launch.clusters import in_skypilot, in_slurm

# Flags whose defaults we choose ourselves; None after parsing means neither the flag nor its PET_* form was given.
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
    if args.nnodes is None and slurm and max_nodes_of(environ["SLURM_NNODES"], "SLURM_NNODES") > 1:
        check_slurm_step(environ)
        args.nnodes = environ["SLURM_NNODES"]
    args.nnodes = args.nnodes or TORCHRUN_DEFAULTS["nnodes"]
    if args.nproc_per_node is None:
        args.nproc_per_node = str(max(visible_gpu_count(), 1))
    max_nodes = max_nodes_of(args.nnodes)
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
    if max_nodes_of(args.nnodes, "SKYPILOT_NUM_NODES") > 1 and not args.rdzv_endpoint \
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
    max_nodes = max_nodes_of(args.nnodes)
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


def max_nodes_of(nnodes: str, source: str = "--nnodes") -> int:
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
    return max_nodes_of(args.nnodes) * local_world_size(args.nproc_per_node)

