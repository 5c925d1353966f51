"""Which cluster environment a node runs in (torchrun's PET_*, a Kubeflow TrainJob, a PyTorchJob pod, SLURM, SkyPilot)
and what distrib does with it: one small function per environment, each a pure function of an env mapping. The
launcher fills its defaults from them; distrib train and distrib doctor name the environment found."""

from __future__ import annotations

import re
import socket
from typing import Mapping

from distrib.errors import UserError

SKYPILOT_PORT = 29500  # the head's rendezvous port under SkyPilot (PET_MASTER_PORT or --master-port to change it)
# Precedence, highest first: flags on the command line, then PET_* (set for this launch on purpose; torchrun reads
# them), then what a scheduler says of the allocation (SLURM_*, SKYPILOT_*).
PRECEDENCE = "flags > PET_* > SLURM/SkyPilot"


def in_slurm(environ: Mapping[str, str]) -> bool:
    return all(key in environ for key in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_JOB_NODELIST"))


def in_skypilot(environ: Mapping[str, str]) -> bool:
    return all(key in environ for key in ("SKYPILOT_NODE_IPS", "SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES"))


def has_pet(environ: Mapping[str, str]) -> bool:
    return any(key in environ for key in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK"))


def is_worker(environ: Mapping[str, str]) -> bool:
    """A launcher (torchrun, distrib launch, a PyTorchJob pod's own RANK, Ray) already made this process a worker."""
    return "RANK" in environ


def is_trainjob(environ: Mapping[str, str]) -> bool:
    """Kubeflow Trainer's torch-distributed runtime: PET_MASTER_ADDR is <job>-node-0-0.<job>, its first pod."""
    return has_pet(environ) and bool(re.match(r"[^.]+-node-0-0\.", environ.get("PET_MASTER_ADDR", "")))


def is_pytorchjob_pod(environ: Mapping[str, str]) -> bool:
    """training-operator v1 gives each pod RANK, WORLD_SIZE and MASTER_* for one process (scripts/k8s/pytorchjob.yaml
    adds LOCAL_RANK=0 in its pods); torchrun's workers have TORCHELASTIC_RUN_ID, Ray's NODE_RANK."""
    return (all(key in environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
            and "TORCHELASTIC_RUN_ID" not in environ and "NODE_RANK" not in environ
            and ("LOCAL_RANK" not in environ or "KUBERNETES_SERVICE_HOST" in environ))


def check_pod(environ: Mapping[str, str]) -> None:
    """A PyTorchJob with nprocPerNode > 1 (training-operator 1.7+) expects torchrun in each pod: its WORLD_SIZE counts
    processes but RANK counts pods, so a pod's one process would join a group that never fills."""
    nproc = environ.get("PET_NPROC_PER_NODE", "")
    if is_pytorchjob_pod(environ) and nproc.isdigit() and int(nproc) > 1:
        raise UserError(f"a PyTorchJob pod with PET_NPROC_PER_NODE={nproc} (nprocPerNode) and RANK={environ['RANK']}: "
                        "distrib train runs one process per pod here; drop nprocPerNode (one pod per device, "
                        "scripts/k8s/pytorchjob.yaml), or use a TrainJob (scripts/k8s/trainjob.yaml)")


def wants_launcher(environ: Mapping[str, str]) -> bool:
    """`distrib train` with no launch flag starts workers as distrib launch does when PET_* or SkyPilot's variables
    describe nodes and no launcher made this process a worker yet."""
    return not is_worker(environ) and (has_pet(environ) or in_skypilot(environ))


def name(environ: Mapping[str, str]) -> str:
    """The environment found, as distrib doctor says it."""
    if "TORCHELASTIC_RUN_ID" in environ:
        return "a worker of torchrun or distrib launch"
    if is_pytorchjob_pod(environ):
        return "Kubeflow PyTorchJob pod (RANK, WORLD_SIZE, MASTER_*)"
    if is_worker(environ):
        return "a worker (RANK set by its launcher)"
    if is_trainjob(environ):
        return "Kubeflow TrainJob (PET_*)"
    found = [label for label, present in (("torchrun variables (PET_*)", has_pet(environ)),
                                          ("SLURM", in_slurm(environ)), ("SkyPilot", in_skypilot(environ)))
             if present]
    return " and ".join(found) or "none"


def plan(environ: Mapping[str, str]) -> str:
    """What distrib train does here, in one sentence."""
    if is_pytorchjob_pod(environ):
        return (f"runs as rank {environ['RANK']} of WORLD_SIZE={environ['WORLD_SIZE']}, one process per pod, with "
                f"the store at MASTER_ADDR={environ['MASTER_ADDR']}")
    if is_worker(environ):
        return "runs as this one worker"
    if wants_launcher(environ):
        return f"starts this node's workers as distrib launch does ({PRECEDENCE})"
    if in_slurm(environ):
        return "one process, unless given launch flags (then SLURM gives the nodes and the rendezvous)"
    return "one process, unless given launch flags (--nproc-per-node, --nnodes ...)"


def skypilot_nodes(environ: Mapping[str, str]) -> tuple[str, str, str]:
    """(head IP, this node's rank, number of nodes) from SkyPilot's variables; the head's IP is the first line."""
    ips = environ["SKYPILOT_NODE_IPS"].split()
    if not ips:
        raise UserError("SKYPILOT_NODE_IPS is empty: SkyPilot names the nodes' IPs there, head first; run under "
                        "sky launch, or give --master-addr")
    return ips[0], environ["SKYPILOT_NODE_RANK"], environ["SKYPILOT_NUM_NODES"]


def check_agreement(nnodes: str | None, environ: Mapping[str, str]) -> None:
    """PET_NNODES (what torchrun would use) against the schedulers' node counts: when they differ and no --nnodes
    flag settled it, the nodes would wait for a count that never arrives, so it is an error naming the winner."""
    pet = environ.get("PET_NNODES")
    if pet is None or nnodes != pet:  # no PET_NNODES, or a --nnodes flag overrode it: the flag wins
        return
    for key, present in (("SLURM_NNODES", in_slurm(environ)), ("SKYPILOT_NUM_NODES", in_skypilot(environ))):
        if present and environ[key] != pet.split(":")[-1]:
            raise UserError(f"PET_NNODES={pet} but {key}={environ[key]}: PET_* would win ({PRECEDENCE}: PET_* is "
                            f"set for this launch, {key} describes the allocation), so the nodes would wait for "
                            f"{pet} nodes; make them agree, unset PET_NNODES, or give --nnodes")


def check_node_rank(node_rank: int, max_nodes: int, source: str) -> None:
    if not 0 <= node_rank < max_nodes:
        raise UserError(f"{source}={node_rank} is out of range for {max_nodes} node(s): need 0 <= node rank < "
                        f"{max_nodes}; give each node its own rank from 0, or fix the node count")


def check_resolves(host: str, source: str) -> None:
    """The rendezvous host resolves here, said once instead of the agent's traceback after its retries."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"{source}: the rendezvous host {host!r} does not resolve ({e}); give the first node's "
                        "hostname or IP as every node reaches it") from None
