"""The one mesh of a run: how its ranks split into pipeline stages, replicas, shard groups (and within them the
expert-parallel groups) and tensor-parallel groups (ParallelDims: sizes, checked against the world, a pure function of
them so that `distrib plan` lays out any world without one), torch's DeviceMesh built from them once, and every rank's
coordinates on it.

Ranks are numbered node by node, so the innermost dimensions stay on one node: tensor parallel innermost (the most
traffic), then the shard groups, then the replicas across nodes (one all-reduce of gradient shards per step), and
the pipeline's stages outermost (one activation per micro-batch between neighbours). A dimension of size 1 is left
out of the mesh, except the data-parallel one a wrapper needs (docs/layouts.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from distrib.torch_private import concatenate_meshes, flatten_mesh, forget_dtensor_plans

# Each degree's mesh dimension, outermost first.
PP, REPLICATE, SHARD, CP, TP = "pp", "replicate", "shard", "cp", "tp"
# Under context parallel FSDP2 shards over the shard and context ranks together, their flattened product
# (torchtitan's dp_shard_cp): the context ranks' gradients of one parameter are parts of one sum.
SHARD_CP = "shard_cp"
# Under expert parallel the shard dimension is built as two, (shard / E, E), and the dense parameters' `shard` is
# their flattened product: the experts are split over `ep` and sharded over the rest (torchtitan's dp_shard_mod_ep).
SHARD_MOD_EP, EP = "shard_mod_ep", "ep"
# Under both, a rank's experts are sharded over the ranks that hold the same ones: (shard_mod_ep, cp) flattened (the
# cp ranks' gradients of an expert are parts of one sum, as the dense parameters' are).
SHARD_MOD_EP_CP = "shard_mod_ep_cp"


@dataclass(frozen=True)
class ParallelDims:
    """Every parallel degree of a run: pipeline x replicate x shard x tensor_parallel = world size. fully_shard: FSDP2
    holds the data-parallel ranks' state (as shards: shard > 1; replicated across `replicate`); else DDP keeps a whole
    replica on every one of them. expert_parallel: the ranks of a shard group that split each MoE layer's experts
    among them (a divisor of shard; they read different batches, so the world and the data ranks stay as they are).

    The strategy holds the run's one ParallelDims and its built mesh (`mesh`); the data slicing, the losses, the rank
    agreement, the pipeline and distrib plan read their coordinates and counts from it, never from rank arithmetic of
    their own."""

    replicate: int
    shard: int
    tensor_parallel: int = 1
    pipeline: int = 1
    fully_shard: bool = True
    expert_parallel: int = 1
    # dist.fault_tolerant_groups: replica groups outside torch's mesh (each its own world, kept in step by torchft:
    # distrib.distributed.fault_tolerance). The mesh spans one group; the groups read different micro-batches.
    fault_tolerant_groups: int = 1
    # dist.context_parallel: ranks that each hold a cut of every sequence (between shard and tp); they read the same
    # micro-batches (distrib.distributed.dimensions.context).
    context_parallel: int = 1
    # The DeviceMesh once built (build_mesh), by device type: not a size, so not compared.
    _built: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def replicas(cls, world_size: int) -> "ParallelDims":
        """Every rank a whole replica (ddp; a trained model evaluated at any world size)."""
        return cls(world_size, 1, fully_shard=False)

    @property
    def world_size(self) -> int:
        return self.pipeline * self.replicate * self.shard * self.context_parallel * self.tensor_parallel

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

    @property
    def token_split(self) -> int:
        """How many ranks each hold a part of one sample's tokens (context parallel's cut; 1 without): they read the
        same micro-batch, so a step's tokens are routed and counted over data_parallel x token_split ranks."""
        return self.context_parallel

    @property
    def batch_sharers(self) -> int:
        """The ranks of one pipeline stage that read the same micro-batch (a tensor-parallel group's times the
        token_split ones): the innermost dimensions, so the stride between two neighbouring shard ranks."""
        return self.world_size // (self.pipeline * self.data_parallel)

    def shard_group(self) -> tuple[str, int]:
        """(name, size) of the dimension FSDP2 shards the dense parameters over (data_parallel_mesh's last): `shard`
        (under expert parallel the flattened (shard_mod_ep, ep) of that name), under context parallel shard_cp."""
        return (SHARD_CP, self.shard * self.context_parallel) if self.context_parallel > 1 else (SHARD, self.shard)

    def expert_shard_group(self) -> tuple[str, int]:
        """(name, size) of the dimension FSDP2 shards each rank's experts over (expert_meshes' rest): shard_mod_ep,
        under context parallel shard_mod_ep_cp."""
        size = self.shard // self.expert_parallel * self.context_parallel
        return (SHARD_MOD_EP_CP if self.context_parallel > 1 else SHARD_MOD_EP), size

    def dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the mesh torch builds, outermost first. FSDP2 replicates over a leading dimension and shards
        over the last, so its data-parallel part is (shard) or (replicate, shard), shard possibly 1 (ddp under
        pipeline parallel: replicated stages); DDP's is (replicate)."""
        pp = ((PP, self.pipeline),) if self.pipeline > 1 else ()
        cp = ((CP, self.context_parallel),) if self.context_parallel > 1 else ()
        tp = ((TP, self.tensor_parallel),) if self.tensor_parallel > 1 else ()
        return pp + self.data_parallel_dims() + cp + tp

    def data_parallel_dims(self) -> tuple[tuple[str, int], ...]:
        if not self.fully_shard:
            return ((REPLICATE, self.replicate),)
        experts = self.expert_parallel
        shard = ((SHARD_MOD_EP, self.shard // experts), (EP, experts)) if experts > 1 else ((SHARD, self.shard),)
        return (((REPLICATE, self.replicate),) if self.replicate > 1 else ()) + shard

    def layout(self) -> dict[str, int]:
        """{dimension: size}: the mesh torch builds."""
        return dict(self.dims())

    def describe(self) -> str:
        """'pp 2 x shard 4 (ep 2) x tp 2': the layout in words, the expert-parallel split named within its shard."""
        words = {name: f"{name} {size}" for name, size in self.layout().items()}
        if EP in words:
            words[SHARD_MOD_EP] = f"{SHARD} {self.shard} ({EP} {self.expert_parallel})"
            del words[EP]
        return " x ".join(words.values())

    # ---------------------------------------------------------------- coordinates

    def coordinate(self, rank: int) -> dict[str, int]:
        """rank's index along each degree (size-1 ones 0): the row-major layout init_device_mesh gives the ranks; `ep`,
        a split of `shard`, is its index in its expert-parallel group (which experts it holds): shard % E."""
        sizes = {PP: self.pipeline, REPLICATE: self.replicate, SHARD: self.shard, CP: self.context_parallel,
                 TP: self.tensor_parallel}
        found, rest = {}, rank
        for name in reversed(list(sizes)):
            rest, found[name] = divmod(rest, sizes[name])
        return {**{name: found[name] for name in sizes}, EP: found[SHARD] % self.expert_parallel}

    def rank_at(self, **coordinate: int) -> int:
        """The global rank at this coordinate (the degrees not given: 0; `ep` is read from `shard`)."""
        sizes = {PP: self.pipeline, REPLICATE: self.replicate, SHARD: self.shard, CP: self.context_parallel,
                 TP: self.tensor_parallel}
        rank = 0
        for name, size in sizes.items():
            rank = rank * size + coordinate.get(name, 0)
        return rank

    def batch_rank(self, rank: int, group: int = 0) -> int:
        """Which micro-batch stream a rank reads: its index on the batch mesh (replicate x shard), after the streams
        of the fault-tolerant replica groups before its `group` (a group restarted reads what it read before)."""
        at = self.coordinate(rank)
        return group * self.data_parallel + at[REPLICATE] * self.shard + at[SHARD]

    @property
    def batch_ranks(self) -> int:
        """The micro-batch streams of a step: the batch mesh's, in every fault-tolerant replica group."""
        return self.fault_tolerant_groups * self.data_parallel

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

            _forget_earlier_meshes()
            names, sizes = zip(*self.dims())
            mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
            if self.expert_parallel > 1 and self.fully_shard:  # the dense parameters' shard group: one more group
                flatten_mesh(mesh[SHARD_MOD_EP, EP], SHARD)
            if self.context_parallel > 1 and self.fully_shard:  # the parameters' shard group: shard x cp
                self._shard_cp(mesh)
                if self.expert_parallel > 1:  # and the experts': shard_mod_ep x cp
                    flatten_mesh(mesh[SHARD_MOD_EP, CP], SHARD_MOD_EP_CP)
            self._built[device_type] = mesh
        return self._built[device_type]

    @property
    def mesh(self):
        """The mesh built (build_mesh): one per run."""
        if len(self._built) != 1:
            raise RuntimeError("ParallelDims.mesh read before build_mesh (or after builds on two device types)")
        return next(iter(self._built.values()))

    def data_parallel_mesh(self, mesh=None):
        """The submesh FSDP2 shards and replicates the (dense) parameters over: (replicate, shard), `shard` under expert
        parallel the flattened (shard_mod_ep, ep) that build_mesh made, under context parallel the flattened shard x
        cp (shard_cp)."""
        mesh = mesh or self.mesh
        if not self.fully_shard or (self.expert_parallel == 1 and self.context_parallel == 1):
            return mesh[tuple(name for name, _ in self.data_parallel_dims())]
        # the one build_mesh made (kept by the root mesh)
        shard = self._shard_cp(mesh) if self.context_parallel > 1 else flatten_mesh(mesh[SHARD_MOD_EP, EP], SHARD)
        # (replicate, shard) joined as FSDP2 joins its meshes: slicing a flattened dimension out of the root is
        # deprecated in torch 2.14
        return concatenate_meshes([mesh[REPLICATE], shard]) if self.replicate > 1 else shard

    def _shard_cp(self, mesh):
        """The shard and cp ranks flattened into one dimension (shard_cp): shard's own, or its (shard_mod_ep, ep)."""
        shard = (SHARD_MOD_EP, EP) if self.expert_parallel > 1 else (SHARD,)
        return flatten_mesh(mesh[(*shard, CP)], SHARD_CP)

    def expert_meshes(self, mesh=None):
        """(ep, the experts' data-parallel submesh): the dimension each MoE layer's experts are split over, and the
        (replicate, shard_mod_ep) FSDP2 shards and replicates each rank's experts over; under context parallel
        shard_mod_ep x cp flattened (the cp ranks hold the same experts, each routing its own tokens)."""
        mesh = mesh or self.mesh
        if self.context_parallel == 1:
            return mesh[EP], mesh[(REPLICATE, SHARD_MOD_EP) if self.replicate > 1 else (SHARD_MOD_EP,)]
        rest = flatten_mesh(mesh[SHARD_MOD_EP, CP], SHARD_MOD_EP_CP)  # the one build_mesh made
        return mesh[EP], concatenate_meshes([mesh[REPLICATE], rest]) if self.replicate > 1 else rest


def _forget_earlier_meshes() -> None:
    """Empties DTensor's caches of sharding and redistribution plans: they are keyed by meshes, which compare equal by
    their ranks and names alone, so after another process group's run in this process (distrib.fit's, the tests' runs
    in one launch) a mesh of the same shape would get that run's mesh back, and its destroyed groups (measured: the
    experts' norm of a pp 2 x ep 2 run after an ep 2 x fsdp 2 one)."""
    forget_dtensor_plans()


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def either(options: list[int]) -> str:
    """'1, 2 or 4': the degrees a refusal offers."""
    return ", ".join(map(str, options[:-1])) + f" or {options[-1]}" if len(options) > 1 else str(options[0])
