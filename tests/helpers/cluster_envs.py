"""What each cluster engine gives a node or pod (Kubeflow TrainJob, PyTorchJob, SkyPilot), and the commands of the
manifests in scripts/k8s and scripts/skypilot, for tests/unit/test_clusters.py and tests/integration/test_launch.py."""

from __future__ import annotations

import yaml

from tests.helpers.support import REPO

TRAINJOB, PYTORCHJOB = REPO / "scripts" / "k8s" / "trainjob.yaml", REPO / "scripts" / "k8s" / "pytorchjob.yaml"
SKYPILOT = REPO / "scripts" / "skypilot" / "train.yaml"


def trainjob_env(node_rank: int, port: int, nnodes: int = 2, nproc: int = 2, addr: str = "127.0.0.1") -> dict:
    """What Kubeflow Trainer's torch-distributed runtime gives a node's pod (loopback for the master's name)."""
    return {"PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": str(nproc), "PET_NODE_RANK": str(node_rank),
            "PET_MASTER_ADDR": addr, "PET_MASTER_PORT": str(port)}


def pytorchjob_env(rank: int, port: int, world_size: int = 4) -> dict:
    """What training-operator v1 gives each pod of a PyTorchJob, plus the manifest's own env entries."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size), "RANK": str(rank),
            "KUBERNETES_SERVICE_HOST": "10.96.0.1",  # in every pod
            **{item["name"]: item["value"] for item in pytorchjob_container()["env"]}}


def skypilot_env(node_rank: int, nnodes: int = 2, gpus: int = 0) -> dict:
    ips = "\n".join(["127.0.0.1"] + [f"10.0.0.{i}" for i in range(1, nnodes)])
    return {"SKYPILOT_NODE_IPS": ips, "SKYPILOT_NODE_RANK": str(node_rank), "SKYPILOT_NUM_NODES": str(nnodes),
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus)}


def documents(path) -> list[dict]:
    return list(yaml.safe_load_all(path.read_text()))


def trainjob_command() -> list[str]:
    return [doc for doc in documents(TRAINJOB) if doc["kind"] == "TrainJob"][0]["spec"]["trainer"]["command"]


def pytorchjob_container() -> dict:
    return documents(PYTORCHJOB)[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def skypilot_command() -> list[str]:
    (line,) = [line for line in documents(SKYPILOT)[0]["run"].splitlines() if line.strip()]
    return line.split()
