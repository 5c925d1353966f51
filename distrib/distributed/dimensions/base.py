"""What a parallel degree declares about itself (Dimension: every hook a no-op by default), what one parallelize call
hands its steps (Layout), and the plan's unit of traffic (group_split: the bytes one rank sends in a ring collective
over a mesh dimension). A degree declares these once, in its own module; the mesh, parallelize, the step, the plan
and the start-up line iterate over the declared degrees (distrib.distributed.dimensions.DIMENSIONS)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Mapping, NamedTuple

import torch.nn as nn

from distrib.config import Config, DistConfig, SpeedConfig
from distrib.distributed.across import StepAcross
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import LaunchEnv, Runtime

# Places in parallelize's order (torchtitan's): the degrees that split the model's tensors first, so that FSDP shards
# their slices (tensor parallel, then expert parallel, so that FSDP shards each rank's own experts); then what changes
# the module itself (activation checkpointing, channels_last: parallelize's own step); data parallel last, so that its
# hooks wrap everything else.
SPLIT_TENSORS, SPLIT_EXPERTS, PREPARE, DATA_PARALLEL = 10, 20, 30, 40

Mesh = tuple[tuple[str, int], ...]  # (name, size) of a mesh's dimensions, outermost first
Words = tuple[tuple[str, str], ...]  # (mesh dimension, its words in the layout line)


@dataclass
class Layout:
    """One parallelize call: what its steps read, and what a step hands a later one (`experts`: the modules expert
    parallel split, with the submesh and divisor FSDP2 shards them over as units of their own). One per call."""

    dims: ParallelDims
    config: DistConfig
    runtime: Runtime
    speed: SpeedConfig
    precision: str
    log: Callable[[str], None]
    roots: list[nn.Module] | None  # one pipeline rank's stages, FSDP roots of their own (None: the model whole)
    find_unused_parameters: bool
    experts: tuple | None = None


@dataclass(frozen=True)
class Training:
    """What a degree's hook around the training steps reads: the worker's config and runtime, the training state
    (distrib.training.state.TrainState), the batch plan, the recorder, the run's steps, and a Checkpointer of any
    config's checkpoint.dir (another world's: to load from)."""

    config: Config
    runtime: Runtime
    state: object
    plan: object
    recorder: object
    total_steps: int | None
    checkpointer_at: Callable


@dataclass(frozen=True)
class StepCost:
    """What the plan's traffic of one optimizer step is counted from. passes: the forwards of a parameter's gathered
    block per step (micro-steps, times a pipeline's microbatches); activation_bytes: what tensor parallel all-reduces
    per forward; root_share: the share of local_params outside the blocks (FSDP2 units gathered once a micro-step
    under a pipeline); expert_params: those of local_params in experts that expert parallel split (FSDP2 shards
    them over the shard dimension's rest, shard_mod_ep); buffer_bytes: the model's buffers (DDP broadcasts them from
    rank 0 before each forward)."""

    per_node: int
    local_params: int
    compute_bytes: int
    passes: int
    activation_bytes: float = 0
    root_share: float = 0
    expert_params: int = 0
    buffer_bytes: int = 0
    # what the degrees' forwards count of a rank's own per pass (Dimension.counted: context parallel's keys and
    # values), in bytes: (all-gathered: again where activation checkpointing recomputes a block, reduce-scattered:
    # their gradients in backward)
    counted_bytes: tuple[float, float] = (0, 0)


class Traffic(NamedTuple):
    """What each rank sends per optimizer step in one kind of collective over one mesh dimension (its name in the
    mesh: 'shard', 'tp', 'replicate+shard' for a flattened pair): (intra-node, inter-node) bytes."""

    dimension: str
    kind: str  # all-gather, reduce-scatter, all-reduce, all-to-all, send
    intra: float
    inter: float


def group_split(size: int, inner: int, per_node: int, nbytes: float, rounds: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank sends in a ring collective over a mesh dimension of `size` ranks
    spaced `inner` apart (ranks numbered node by node), done hierarchically: within the node over its ranks of the
    group, then across nodes on 1/l of the data each. rounds: 1 all-gather / reduce-scatter, 2 all-reduce."""
    local = max(1, min(size, per_node // inner)) if per_node % inner == 0 else 1
    nodes = size // local
    return rounds * (local - 1) / local * nbytes, rounds * (nodes - 1) / nodes * nbytes / local


class Dimension:
    """One parallel degree, declared once. A subclass overrides the hooks it needs; the rest do nothing, so a degree
    that adds no mesh dimension (replica groups) or no parallelize step (the pipeline, which cuts the model before)
    declares only what it has."""

    name = ""
    keys: tuple[str, ...] = ()  # the dist.* keys it owns
    step_at: int | None = None  # its place in parallelize's order (SPLIT_TENSORS...), None: no step there
    names_layout = False  # whether the start-up memory line spells the layout out when it is on
    checks_model = False  # whether check_model has something to check (the launcher builds the model on meta)
    traffic_name = ""  # the plan's name for its traffic when it has a line of its own ('' : counted in the total)

    def on(self, dims: ParallelDims) -> bool:
        """Whether this run has it (a degree above 1)."""
        return False

    # ---------------------------------------------------------------- the config and the sizes

    def check(self, config: Config) -> None:
        """Its one-line ConfigError refusals (key, value, fix), alone and against the other keys, before any worker."""

    def share(self, config: DistConfig, world_size: int, rest: int, local_world_size: int) -> int:
        """How many of `rest` (the world once the degrees before took theirs) it takes before the data-parallel ranks
        are counted; a one-line ConfigError when it does not divide them."""
        return 1

    def worlds(self, config: DistConfig, world_size: int, local_world_size: int) -> int:
        """Into how many worlds of their own (each its own mesh) it splits a job of world_size ranks (the plan's
        world; a worker's is its own already); a one-line ConfigError when they do not tile it."""
        return 1

    def shards_state(self, config: DistConfig) -> bool:
        """Whether it needs the state held in shards (FSDP2) whatever dist.strategy names."""
        return False

    def sizes(self, config: DistConfig) -> dict[str, int]:
        """Its fields of ParallelDims (the mesh's record), from the config."""
        return {}

    def check_sizes(self, dims: ParallelDims, config: DistConfig) -> None:
        """A one-line ConfigError for a size that does not fit the laid-out degrees (its group's ranks)."""

    def check_model(self, model: nn.Module, dims: ParallelDims, world_size: int) -> None:
        """A one-line ConfigError for a model (built on meta) it cannot lay out; called when on()."""

    # ---------------------------------------------------------------- the mesh and the words

    def mesh_dims(self, dims: ParallelDims, mesh: Mesh) -> Mesh:
        """The mesh with its dimension(s) in place, given the dimensions of the degrees declared before it."""
        return mesh

    def words(self, dims: ParallelDims, words: Words) -> Words:
        """The layout's words with its own in place ('pp 2', 'shard 4 (ep 2)')."""
        return words

    # ---------------------------------------------------------------- parallelize and the step

    def parallelize(self, model: nn.Module, layout: Layout) -> nn.Module:
        """Its step in parallelize (at step_at): the model laid out over its mesh dimension."""
        return model

    def transform_batch(self, batch, dims: ParallelDims, rank: int):
        """What it does to a micro-batch before the forward (context parallel: this rank's cut of the sequence)."""
        return batch

    def counted(self, inputs, dims: ParallelDims) -> tuple[object, Callable[[], int]]:
        """The plan's forward of this rank's cut inputs (transform_batch's): the inputs with what counts the elements
        it sends per forward, and the count once the forward ran (context parallel: its keys and values)."""
        return inputs, lambda: 0

    def loss_count(self, count: int, dims: ParallelDims) -> int:
        """How many shares a step's loss is normalised into, from `count` ranks' that each count their micro-batch's
        targets whole (losses.step_loss): context parallel, whose ranks each backward 1/C of them, times its degree."""
        return count

    def around_training(self, training: Training) -> ContextManager[StepAcross | None]:
        """What it holds around the worker's training steps: a context that yields what each step agrees on with
        the other worlds (StepAcross), or None."""
        return contextlib.nullcontext(None)

    # ---------------------------------------------------------------- the launcher

    def launch_flags(self, config: Config, environ: Mapping[str, str]) -> list[str]:
        """distrib launch's flags that `distrib train` adds for it (a worker's environment: none)."""
        return []

    def worker_config(self, config: Config, env: LaunchEnv) -> Config:
        """The config this worker runs, given its launch environment (its own folders, say)."""
        return config

    # ---------------------------------------------------------------- what the plan counts

    def passes(self, dims: ParallelDims, config: DistConfig) -> int:
        """How many forwards each micro-step runs per block (a pipeline: its microbatches)."""
        return 1

    def traffic(self, dims: ParallelDims, config: DistConfig, step: StepCost) -> list[Traffic]:
        """What each rank sends per optimizer step over its dimension(s), by mesh dimension and collective."""
        return []
