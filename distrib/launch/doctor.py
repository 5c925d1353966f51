"""`distrib doctor`: prints what a launch would see (torch, CUDA/NCCL/gloo, devices, launch and SLURM variables) and
checks it before any process group exists. Each check is a pure function of an env mapping and machine facts."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping

from distrib.launch import clusters

LAUNCH_PREFIXES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                   "MASTER_", "TORCHELASTIC_", "PET_", "SKYPILOT_", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
SLURM_PREFIX = "SLURM_"


@dataclass(frozen=True)
class Facts:
    """What the checks need to know about this machine, gathered once (tests pass made-up ones)."""

    num_gpus: int = 0
    has_scontrol: bool = True
    port_in_use: Callable[[int], bool] = field(default=lambda port: False)


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    message: str  # what was seen; for a failure also what to do


def _int(env: Mapping[str, str], key: str) -> int | None:
    try:
        return int(env[key])
    except (KeyError, ValueError):
        return None


def _max_nodes(text: str | None) -> int | None:
    try:
        return int(text.split(":")[-1]) if text else None
    except ValueError:
        return None


def num_nodes(env: Mapping[str, str]) -> int:
    """How many nodes this run spans, from whichever launcher or scheduler variables are present."""
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    candidates = [_int(env, "GROUP_WORLD_SIZE"), _max_nodes(env.get("PET_NNODES")), _int(env, "NNODES"),
                  _int(env, "SLURM_NNODES"), _int(env, "SKYPILOT_NUM_NODES"),
                  -(-world // local) if world and local else None]
    return max([n for n in candidates if n] or [1])


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_local_rank(env: Mapping[str, str], facts: Facts) -> Finding:
    name, local_rank = "local rank vs GPUs", _int(env, "LOCAL_RANK")
    local_world = _int(env, "LOCAL_WORLD_SIZE")
    visible = f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    if not facts.num_gpus:
        return Finding(name, True, "no CUDA device visible: workers run on the CPU")
    rank = _int(env, "RANK")
    if local_rank is None and rank is not None and rank >= facts.num_gpus and clusters.is_pytorchjob_pod(env):
        return Finding(name, False, f"RANK={rank} and no LOCAL_RANK, which then defaults to RANK, but this pod has "
                                    f"{facts.num_gpus} CUDA device(s); set LOCAL_RANK=0 and LOCAL_WORLD_SIZE=1 in the "
                                    "pod's env, as scripts/k8s/pytorchjob.yaml does")
    if local_rank is not None and local_rank >= facts.num_gpus:
        return Finding(name, False, f"LOCAL_RANK={local_rank} but {facts.num_gpus} CUDA device(s) are visible "
                                    f"({visible}); launch with --nproc-per-node={facts.num_gpus} or fix "
                                    "CUDA_VISIBLE_DEVICES")
    if local_world is not None and local_world > facts.num_gpus:
        return Finding(name, False, f"LOCAL_WORLD_SIZE={local_world} workers but {facts.num_gpus} CUDA device(s) "
                                    f"are visible ({visible}); launch with --nproc-per-node={facts.num_gpus}")
    return Finding(name, True, f"{facts.num_gpus} CUDA device(s) visible ({visible})")


def check_master_addr(env: Mapping[str, str], facts: Facts) -> Finding:
    name, nodes = "master address", num_nodes(env)
    addresses = [(key, env[key]) for key in ("MASTER_ADDR", "PET_MASTER_ADDR") if env.get(key)]
    if env.get("PET_RDZV_ENDPOINT"):
        addresses.append(("PET_RDZV_ENDPOINT", env["PET_RDZV_ENDPOINT"].rpartition(":")[0] or env["PET_RDZV_ENDPOINT"]))
    for key, host in addresses:
        if nodes > 1 and is_loopback(host):
            return Finding(name, False, f"{key}={env[key]} is a loopback address but the run spans {nodes} nodes, "
                                        "so the other nodes cannot reach it; use the first node's hostname or IP, "
                                        "e.g. $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)")
    seen = ", ".join(f"{key}={value}" for key, value in addresses) or "not set"
    return Finding(name, True, f"{seen} ({nodes} node(s))")


def check_port(env: Mapping[str, str], facts: Facts) -> Finding:
    name = "master port"
    key = next((k for k in ("MASTER_PORT", "PET_MASTER_PORT") if env.get(k)), None)
    if key is None:
        return Finding(name, True, "not set: distrib launch picks a free port")
    if "TORCHELASTIC_RUN_ID" in env:  # inside a launched worker the launcher's own store holds the port
        return Finding(name, True, f"{key}={env[key]}, held by the launcher of this worker")
    host = env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR") or "localhost"
    if not (is_loopback(host) or host in (socket.gethostname(), socket.getfqdn())):
        return Finding(name, True, f"{key}={env[key]} on {host}, another machine: not checked from here")
    try:
        port = int(env[key])
    except ValueError:
        return Finding(name, False, f"{key}={env[key]!r} is not a port number; unset it or give a number")
    if facts.port_in_use(port):
        return Finding(name, False, f"{key}={port} is already in use on this machine (another job?); pick a free "
                                    f"port, or unset {key} and let distrib launch pick one")
    return Finding(name, True, f"{key}={port} is free")


def check_scontrol(env: Mapping[str, str], facts: Facts) -> Finding:
    name = "scontrol"
    if "SLURM_JOB_ID" not in env:
        return Finding(name, True, "not in a SLURM job")
    if not facts.has_scontrol:
        return Finding(name, False, f"inside SLURM job {env['SLURM_JOB_ID']} but scontrol is not on PATH, so the "
                                    "first node cannot be found; install slurm-client (or module load slurm), or "
                                    "give distrib launch --rdzv-endpoint HOST:PORT")
    return Finding(name, True, "on PATH")


def check_slurm_tasks(env: Mapping[str, str], facts: Facts, nproc_per_node: int) -> Finding:
    name = "SLURM tasks vs workers"
    tasks = _int(env, "SLURM_NTASKS_PER_NODE")
    step_tasks, step_nodes = _int(env, "SLURM_STEP_NUM_TASKS"), _int(env, "SLURM_STEP_NUM_NODES")
    if step_tasks and step_nodes and step_tasks > step_nodes:
        tasks = max(tasks or 1, -(-step_tasks // step_nodes))
    if "SLURM_JOB_ID" not in env or not tasks:
        return Finding(name, True, "not in a SLURM job" if "SLURM_JOB_ID" not in env else "one task per node")
    if tasks > 1 and nproc_per_node > 1:
        return Finding(name, False, f"SLURM runs {tasks} tasks per node and each would launch {nproc_per_node} "
                                    f"workers ({tasks * nproc_per_node} per node); with distrib launch use "
                                    "srun --ntasks-per-node=1 (scripts/slurm/train.sbatch does), or drop the launcher")
    return Finding(name, True, f"{tasks} task(s) per node x {nproc_per_node} worker(s)")


def check_store(env: Mapping[str, str], facts: Facts) -> Finding:
    """Not a failure, a fact to know: torch's c10d stores take any client that reaches them."""
    name, nodes = "rendezvous store", num_nodes(env)
    where = ("binds loopback only (no other machine can reach it)" if nodes == 1 else
             "binds only the --rdzv-endpoint address: keep that address on the cluster's private network")
    return Finding(name, True, f"the c10d store has no authentication (anyone who reaches it can write into the "
                               f"job's store); distrib launch {where}")


def check_cluster(env: Mapping[str, str], facts: Facts) -> Finding:
    """The launcher's own checks of the cluster's variables (clusters): node counts that agree, a node rank in
    range, a rendezvous host that resolves."""
    from distrib.errors import UserError

    name = "cluster variables"
    try:
        clusters.check_agreement(env.get("PET_NNODES"), env)
        nodes, rank = _max_nodes(env.get("PET_NNODES")), _int(env, "PET_NODE_RANK")
        if nodes and rank is not None:
            clusters.check_node_rank(rank, nodes, "PET_NODE_RANK")
        if nodes and nodes > 1 and env.get("PET_MASTER_ADDR"):
            clusters.check_resolves(env["PET_MASTER_ADDR"], f"PET_MASTER_ADDR={env['PET_MASTER_ADDR']}")
    except UserError as e:
        return Finding(name, False, str(e))
    return Finding(name, True, f"{clusters.name(env)}: consistent")


def run_checks(env: Mapping[str, str], facts: Facts, nproc_per_node: int) -> list[Finding]:
    checks = [check_local_rank, check_master_addr, check_port, check_store, check_scontrol, check_cluster]
    return [check(env, facts) for check in checks] + [check_slurm_tasks(env, facts, nproc_per_node)]


def port_in_use(port: int) -> bool:
    """True if nothing may listen on `port` here; SO_REUSEADDR as TCPStore, so TIME_WAIT leftovers don't count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def gather_facts() -> Facts:
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Facts(num_gpus, shutil.which("scontrol") is not None, port_in_use)


def describe_torch(facts: Facts) -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    def available(flag: bool, detail: str = "") -> str:
        return f"available{detail}" if flag else "not available"

    nccl = ""
    if facts.num_gpus and dist.is_nccl_available():
        nccl = " " + ".".join(map(str, torch.cuda.nccl.version()))
    devices = [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(facts.num_gpus)]
    return [("torch", torch.__version__),
            ("cuda", available(bool(facts.num_gpus), f" (CUDA {torch.version.cuda})")),
            ("nccl", available(dist.is_available() and dist.is_nccl_available() and bool(facts.num_gpus), nccl)),
            ("gloo", available(dist.is_available() and dist.is_gloo_available())),
            ("devices", ", ".join(devices) or f"no GPU; {len(os.sched_getaffinity(0))} CPU core(s)")]


def _env_rows(env: Mapping[str, str], keep: Callable[[str], bool]) -> list[tuple[str, str]]:
    return sorted((key, value) for key, value in env.items() if keep(key)) or [("(none set)", "")]


def report(env: Mapping[str, str], facts: Facts, findings: list[Finding]) -> str:
    def block(title: str, rows: list[tuple[str, str]]) -> list[str]:
        return [title, *(f"  {key:<26} {value}".rstrip() for key, value in rows)]

    lines = block("torch", describe_torch(facts))
    lines += block("launch environment", _env_rows(env, lambda key: key.startswith(LAUNCH_PREFIXES)))
    lines += block("SLURM environment", _env_rows(env, lambda key: key.startswith(SLURM_PREFIX)))
    lines += block("cluster", [("found", clusters.name(env)), ("distrib train", clusters.plan(env))])
    lines += ["checks", *(f"  {'ok' if f.ok else 'FAIL':<4} {f.name:<22} {f.message}" for f in findings)]
    return "\n".join(lines)


def main(nproc_per_node: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """Prints the report; returns 1 if any check failed, else 0."""
    env = os.environ if env is None else env
    facts = gather_facts()
    nproc = nproc_per_node or _int(env, "LOCAL_WORLD_SIZE") or _int(env, "PET_NPROC_PER_NODE") or max(facts.num_gpus, 1)
    findings = run_checks(env, facts, nproc)
    print(report(env, facts, findings))
    failed = [f.name for f in findings if not f.ok]
    if failed:
        print(f"distrib doctor: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
