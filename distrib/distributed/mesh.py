"""The device mesh of a run: how its ranks split into replicas, shard groups and tensor-parallel groups, checked
against the world (a pure function of sizes, so `distrib plan` lays out any world without one), then built.

Ranks are numbered node by node, so the innermost dimensions stay on one node: tensor parallel innermost (the most
traffic), then hsdp's shard groups, then the replicas across nodes (one all-reduce of gradient shards per step)."""

from __future__ import annotations

from dataclasses import dataclass

from distrib.config import DistConfig
from distrib.errors import ConfigError


@dataclass(frozen=True, slots=True)
class MeshShape:
    """replicate x shard x tensor_parallel = world size. ddp: every rank a replica; fsdp: one shard group of every
    data-parallel rank; hsdp: replicas of shard groups."""

    strategy: str
    replicate: int
    shard: int
    tensor_parallel: int = 1

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tensor_parallel

    @property
    def data_parallel(self) -> int:
        """Ranks that read different micro-batches (the ranks of one tensor-parallel group read the same)."""
        return self.replicate * self.shard

    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the mesh torch builds, outermost first: fsdp keeps a 1-D mesh, hsdp a 2-D one."""
        named = ((("replicate", self.replicate),) if self.strategy == "hsdp" else ()) + (("shard", self.shard),)
        return named + ((("tp", self.tensor_parallel),) if self.tensor_parallel > 1 else ())

    def data_rank(self, rank: int) -> int:
        """Which micro-batch stream a rank reads: its index among the data-parallel ranks (the ranks of one
        tensor-parallel group are neighbours and read the same)."""
        return rank // self.tensor_parallel

    def layout(self) -> dict[str, int]:
        """{dimension: size}: the mesh torch builds, or ddp's replicas (ddp builds none)."""
        return dict(self.dims()) if self.strategy != "ddp" else {"replicate": self.replicate}

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in self.layout().items())


def mesh_shape(config: DistConfig, world_size: int, local_world_size: int) -> MeshShape:
    """The mesh dist.strategy, dist.shard_size and dist.tensor_parallel ask for at this world size, or a one-line
    ConfigError naming the value that does not tile the world and the fix."""
    tp = config.tensor_parallel
    if world_size % tp:
        raise ConfigError(f"dist.tensor_parallel = {tp}: does not divide world size {world_size}; use a divisor "
                          f"of {world_size} (ideally of the {local_world_size} ranks per node)")
    if config.strategy == "ddp":
        return MeshShape("ddp", world_size, 1)
    data_parallel = world_size // tp
    if config.strategy == "fsdp":
        return MeshShape("fsdp", 1, data_parallel, tp)
    shard = config.shard_size or max(1, local_world_size // tp)
    if data_parallel % shard:
        key = "dist.shard_size" if config.shard_size else "LOCAL_WORLD_SIZE / dist.tensor_parallel (dist.shard_size)"
        raise ConfigError(f"{key} = {shard}: does not divide the {data_parallel} data-parallel ranks (world size "
                          f"{world_size} / tensor parallel {tp}); set --set dist.shard_size to a divisor of "
                          f"{data_parallel}, e.g. the ranks of one node")
    return MeshShape("hsdp", data_parallel // shard, shard, tp)


def build_mesh(shape: MeshShape, device_type: str):
    """torch's DeviceMesh of this shape (every rank calls it, in the same order: it creates process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = zip(*shape.dims())
    return init_device_mesh(device_type, sizes, mesh_dim_names=names)


def group_split(size: int, inner: int, per_node: int, nbytes: float, rounds: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends in a ring collective over a mesh dimension of `size` ranks
    spaced `inner` apart (ranks numbered node by node), done hierarchically: within the node over its ranks of the
    group, then across nodes on 1/l of the data each. rounds: 1 all-gather / reduce-scatter, 2 all-reduce."""
    local = max(1, min(size, per_node // inner)) if per_node % inner == 0 else 1
    nodes = size // local
    return rounds * (local - 1) / local * nbytes, rounds * (nodes - 1) / nodes * nbytes / local


def data_parallel_mesh(mesh):
    """The dimensions FSDP shards and replicates over: all but the tensor-parallel one."""
    names = tuple(name for name in mesh.mesh_dim_names if name != "tp")
    return mesh[names] if len(names) < len(mesh.mesh_dim_names) else mesh
