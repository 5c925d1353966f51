"""The one mesh of a run: how its ranks split into pipeline stages, replicas, shard groups and tensor-parallel groups
(ParallelDims: sizes, checked against the world, a pure function of them so that `distrib plan` lays out any world
without one), torch's DeviceMesh built from them once, and every rank's coordinates on it.

Ranks are numbered node by node, so the innermost dimensions stay on one node: tensor parallel innermost (the most
traffic), then the shard groups, then the replicas across nodes (one all-reduce of gradient shards per step), and
the pipeline's stages outermost (one activation per micro-batch between neighbours). A dimension of size 1 is left
out of the mesh, except the data-parallel one a wrapper needs (docs/layouts.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from distrib.config import DistConfig
from distrib.errors import ConfigError

# Each degree's mesh dimension, outermost first.
PP, REPLICATE, SHARD, TP = "pp", "replicate", "shard", "tp"


@dataclass(frozen=True)
class ParallelDims:
    """Every parallel degree of a run: pipeline x replicate x shard x tensor_parallel = world size. fully_shard: FSDP2
    holds the data-parallel ranks' state (as shards: shard > 1; replicated across `replicate`); else DDP keeps a whole
    replica on every one of them.

    The strategy holds the run's one ParallelDims and its built mesh (`mesh`); the data slicing, the losses, the rank
    agreement, the pipeline and distrib plan read their coordinates and counts from it, never from rank arithmetic of
    their own."""

    replicate: int
    shard: int
    tensor_parallel: int = 1
    pipeline: int = 1
    fully_shard: bool = True
    # The DeviceMesh once built (build_mesh), by device type: not a size, so not compared.
    _built: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def replicas(cls, world_size: int) -> "ParallelDims":
        """Every rank a whole replica (ddp; a trained model evaluated at any world size)."""
        return cls(world_size, 1, fully_shard=False)

    @property
    def world_size(self) -> int:
        return self.pipeline * self.replicate * self.shard * self.tensor_parallel

    @property
    def data_parallel(self) -> int:
        """The batch mesh's size: ranks that read different micro-batches (a tensor-parallel group's ranks, and a
        pipeline's stages, read the same)."""
        return self.replicate * self.shard

    @property
    def loss_ranks(self) -> int:
        """The loss mesh's size: the ranks that hold a step's loss, every rank but under pipeline parallel only the
        last stage's."""
        return self.world_size // self.pipeline

    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the mesh torch builds, outermost first. FSDP2 replicates over a leading dimension and shards
        over the last, so its data-parallel part is (shard) or (replicate, shard), shard possibly 1 (ddp under
        pipeline parallel: replicated stages); DDP's is (replicate)."""
        pp = ((PP, self.pipeline),) if self.pipeline > 1 else ()
        tp = ((TP, self.tensor_parallel),) if self.tensor_parallel > 1 else ()
        return pp + self.data_parallel_dims() + tp

    def data_parallel_dims(self) -> tuple[tuple[str, int], ...]:
        if not self.fully_shard:
            return ((REPLICATE, self.replicate),)
        return (((REPLICATE, self.replicate),) if self.replicate > 1 else ()) + ((SHARD, self.shard),)

    def layout(self) -> dict[str, int]:
        """{dimension: size}: the mesh torch builds."""
        return dict(self.dims())

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in self.layout().items())

    # ---------------------------------------------------------------- coordinates

    def coordinate(self, rank: int) -> dict[str, int]:
        """rank's index along each degree (size-1 ones 0): the row-major layout init_device_mesh gives the ranks."""
        sizes = {PP: self.pipeline, REPLICATE: self.replicate, SHARD: self.shard, TP: self.tensor_parallel}
        found, rest = {}, rank
        for name in reversed(list(sizes)):
            rest, found[name] = divmod(rest, sizes[name])
        return {name: found[name] for name in sizes}

    def rank_at(self, **coordinate: int) -> int:
        """The global rank at this coordinate (the degrees not given: 0)."""
        sizes = {PP: self.pipeline, REPLICATE: self.replicate, SHARD: self.shard, TP: self.tensor_parallel}
        rank = 0
        for name, size in sizes.items():
            rank = rank * size + coordinate.get(name, 0)
        return rank

    def batch_rank(self, rank: int) -> int:
        """Which micro-batch stream a rank reads: its index on the batch mesh (replicate x shard)."""
        at = self.coordinate(rank)
        return at[REPLICATE] * self.shard + at[SHARD]

    def pipeline_rank(self, rank: int) -> int:
        """Which pipeline rank (which stages) a rank holds."""
        return self.coordinate(rank)[PP]

    def leads_stage(self, rank: int) -> bool:
        """Whether a rank is its pipeline rank's first (every other coordinate 0): it speaks for its stages."""
        return rank == self.rank_at(pp=self.pipeline_rank(rank))

    # ---------------------------------------------------------------- torch's mesh

    def build_mesh(self, device_type: str):
        """torch's DeviceMesh of these dims, built once (every rank calls it, in the same order: it creates process
        groups) and then held; device_type explicit (a CPU run on a GPU host, or distrib plan's fake group)."""
        if device_type not in self._built:
            from torch.distributed.device_mesh import init_device_mesh

            names, sizes = zip(*self.dims())
            self._built[device_type] = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        return self._built[device_type]

    @property
    def mesh(self):
        """The mesh built (build_mesh): one per run."""
        if len(self._built) != 1:
            raise RuntimeError("ParallelDims.mesh read before build_mesh (or after builds on two device types)")
        return next(iter(self._built.values()))

    def data_parallel_mesh(self, mesh=None):
        """The submesh FSDP2 shards and replicates over."""
        mesh = mesh or self.mesh
        return mesh[tuple(name for name, _ in self.data_parallel_dims())]


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
