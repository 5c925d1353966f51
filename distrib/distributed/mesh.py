"""The device mesh of a run: how its ranks split into pipeline stages, replicas, shard groups and tensor-parallel
groups, checked against the world (a pure function of sizes, so `distrib plan` lays out any world without one), then
built.

Ranks are numbered node by node, so the innermost dimensions stay on one node: tensor parallel innermost (the most
traffic), then hsdp's shard groups, then the replicas across nodes (one all-reduce of gradient shards per step), and
the pipeline's stages outermost (one activation per micro-batch between neighbours)."""

from __future__ import annotations

from dataclasses import dataclass

from distrib.config import DistConfig
from distrib.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Every parallel degree of a run: pipeline x replicate x shard x tensor_parallel = world size. ddp: every rank a
    replica; fsdp: one shard group of every data-parallel rank; hsdp: replicas of shard groups; pipeline: stages of
    the model by depth, each held by its own copy of the data-parallel x tensor-parallel ranks.

    The runtime, the strategies, the data slicing, the losses and the rank agreement all read this one object. Its
    batch ranks (replicate x shard) read different samples: counts and losses are summed over them."""

    strategy: str
    replicate: int
    shard: int
    tensor_parallel: int = 1
    pipeline: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline * self.replicate * self.shard * self.tensor_parallel

    @property
    def data_parallel(self) -> int:
        """Ranks that read different micro-batches: the batch mesh (a tensor-parallel group's ranks, and a pipeline's
        stages, read the same)."""
        return self.replicate * self.shard

    @property
    def loss_ranks(self) -> int:
        """Ranks that hold a step's loss: every rank, but under pipeline parallel only the last stage's."""
        return self.world_size // self.pipeline

    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the mesh torch builds, outermost first: pp outermost (its traffic is the least), tp
        innermost (the most). fsdp keeps a 1-D data-parallel part, hsdp a 2-D one; ddp under pp is a 2-D one whose
        shard dimension is 1 (FSDP2 replicating every stage's parameters: no sharding, gradients all-reduced)."""
        pp = (("pp", self.pipeline),) if self.pipeline > 1 else ()
        replicated = self.strategy == "hsdp" or (self.strategy == "ddp" and self.pipeline > 1)
        named = pp + ((("replicate", self.replicate),) if replicated else ()) + (("shard", self.shard),)
        return named + ((("tp", self.tensor_parallel),) if self.tensor_parallel > 1 else ())

    def data_rank(self, rank: int) -> int:
        """Which micro-batch stream a rank reads: its index among the data-parallel ranks (the ranks of one
        tensor-parallel group are neighbours and read the same; so do the stages of one pipeline)."""
        return rank // self.tensor_parallel % self.data_parallel

    def pipeline_rank(self, rank: int) -> int:
        """Which pipeline rank (which stages) a rank holds: its coordinate on the outermost dimension."""
        return rank // (self.world_size // self.pipeline)

    def layout(self) -> dict[str, int]:
        """{dimension: size}: the mesh torch builds, or ddp's replicas (ddp alone builds none)."""
        return dict(self.dims()) if self.strategy != "ddp" or self.pipeline > 1 else {"replicate": self.replicate}

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in self.layout().items())


def data_parallel_size(config: DistConfig, world_size: int, local_world_size: int) -> int:
    """The ranks that read different micro-batches once dist.pipeline_parallel and dist.tensor_parallel have taken
    their share of the world, or a one-line ConfigError naming the degree that does not divide it. How a strategy
    lays these ranks out (replicas, shard groups) is its own: Strategy.replicas_and_shards."""
    pp, tp = config.pipeline_parallel, config.tensor_parallel
    if world_size % pp:
        raise ConfigError(f"dist.pipeline_parallel = {pp}: does not divide world size {world_size}; use "
                          f"{either(divisors(world_size))} (the divisors of {world_size}), or a world size that is a "
                          f"multiple of {pp}")
    if world_size // pp % tp:
        raise ConfigError(f"dist.tensor_parallel = {tp}: does not divide world size {world_size}"
                          + (f" / pipeline parallel {pp}" if pp > 1 else "")
                          + f"; use a divisor of {world_size // pp} (ideally of the {local_world_size} ranks per "
                          f"node), or a world size that is a multiple of {pp * tp}")
    return world_size // (pp * tp)


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def either(options: list[int]) -> str:
    """'1, 2 or 4': the degrees a refusal offers."""
    return ", ".join(map(str, options[:-1])) + f" or {options[-1]}" if len(options) > 1 else str(options[0])


def build_mesh(shape: ParallelDims, device_type: str):
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
    """The dimensions FSDP shards and replicates over: all but the tensor-parallel and pipeline ones."""
    names = tuple(name for name in mesh.mesh_dim_names if name not in ("tp", "pp"))
    return mesh[names] if len(names) < len(mesh.mesh_dim_names) else mesh
