"""Context parallel's declaration (dist.context_parallel = C): its rules, its share of the world, its `cp` mesh
dimension (between the shard ranks and tensor parallel), its words, the model check before any worker, the cut of
each micro-batch (this rank's two chunks of every window) and the loss's shares. Its step in parallelize checks the
model and reaches its attention (a transformers decoder's, through their attention interface): the cut hands the model
what attends over the group (distrib.distributed.context_parallel, the mechanism; packed documents masked by their
documents in the whole window), and FSDP2 shards over the shard and cp ranks together
(ParallelDims.data_parallel_mesh), so that the C ranks' gradients of a parameter are reduced as parts of one sum.
Beside expert parallel (whose ranks are shard ranks: a cp group's ranks hold the same experts) each rank's experts are
sharded over the shard_mod_ep and cp ranks together (ParallelDims.expert_meshes), and the MoE's aux loss counts the
group's choices (distrib.models.moe: balance_loss). Evaluation and generation run whole windows on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.config import Config, DistConfig
from distrib.distributed.context_parallel import (
    ATTEND,
    INPUT_IDS,
    POSITION_IDS,
    cut_batch,
    reach_attention,
    reachable,
    takes_attend,
)
from distrib.distributed.dimensions.base import (
    SPLIT_TENSORS,
    Dimension,
    Layout,
    Mesh,
    StepCost,
    Traffic,
    Words,
    group_split,
)
from distrib.distributed.mesh import CP, ParallelDims
from distrib.errors import ConfigError, UserError


class ContextParallel(Dimension):
    name = "context parallel"
    keys = ("context_parallel",)
    checks_model = True
    step_at = SPLIT_TENSORS  # the model's check where no launcher built it on meta first (distrib.fit, data's vocab)
    names_layout = True  # the strategy's name alone does not say that a rank holds a cut of every sequence

    def on(self, dims: ParallelDims) -> bool:
        return dims.context_parallel > 1

    def check(self, config: Config) -> None:
        dist_config, degree = config.dist, config.dist.context_parallel
        if degree == 1:
            return
        said = f"dist.context_parallel = {degree}"
        if dist_config.strategy == "ddp":
            raise ConfigError(f"{said}: composes with fsdp or hsdp, which shard over the data and context ranks "
                              "together, and dist.strategy is ddp; set --set dist.strategy=fsdp (or hsdp)")
        if config.data.seq_len % (2 * degree):
            fits = max(config.data.seq_len // (2 * degree), 1) * 2 * degree
            raise ConfigError(f"{said}: cuts each sequence into 2 x {degree} chunks, and data.seq_len = "
                              f"{config.data.seq_len} is not a multiple of {2 * degree}; set --set "
                              f"data.seq_len={fits}")

    def share(self, config: DistConfig, world_size: int, rest: int, local_world_size: int) -> int:
        degree = config.context_parallel
        if rest % degree:
            raise ConfigError(f"dist.context_parallel = {degree}: does not divide the {rest} ranks the world size "
                              f"{world_size} leaves it; use a divisor of {rest}, or a world size that is a multiple "
                              f"of {world_size // rest * degree}")
        return degree

    def sizes(self, config: DistConfig) -> dict[str, int]:
        return {"context_parallel": config.context_parallel}

    def check_model(self, model: nn.Module, dims: ParallelDims, world_size: int) -> None:
        if not reachable(model):
            raise ConfigError(f"dist.context_parallel = {dims.context_parallel}: the attention of "
                              f"{type(model).__name__} cannot be reached (its forward takes no `{ATTEND}`, as the "
                              "built-in GPT's does, nor runs transformers' attention interface); use model.name=gpt "
                              "or --set dist.context_parallel=1")
        if dims.pipeline > 1 and not (takes_attend(model) or _decoder_stages(model)):
            raise ConfigError(f"dist.context_parallel = {dims.context_parallel}: beside dist.pipeline_parallel = "
                              f"{dims.pipeline} reaches the attention of the built-in GPT and of transformers "
                              f"decoders with a pipeline plan only, and {type(model).__name__} is neither; use "
                              "model.name=gpt, or --set dist.pipeline_parallel=1")

    def parallelize(self, model: nn.Module, layout: Layout) -> nn.Module:
        if layout.roots is not None:  # a pipeline rank's stages: views of the model's class that run in its place
            for stage in layout.roots:
                self.check_model(stage, layout.dims, layout.dims.world_size)
                reach_attention(stage)
            return model
        self.check_model(model, layout.dims, layout.dims.world_size)
        return reach_attention(model)

    def mesh_dims(self, dims: ParallelDims, mesh: Mesh) -> Mesh:
        return mesh + (((CP, dims.context_parallel),) if self.on(dims) else ())

    def words(self, dims: ParallelDims, words: Words) -> Words:
        return words + (((CP, f"{CP} {dims.context_parallel}"),) if self.on(dims) else ())

    def transform_batch(self, batch, dims: ParallelDims, rank: int):
        """This rank's two chunks of every window of the micro-batch (inputs and targets), with their global
        positions and the attention over the group's keys."""
        if not self.on(dims):
            return batch
        inputs, targets = batch
        tokens = inputs.get(INPUT_IDS) if isinstance(inputs, dict) and set(inputs) == {INPUT_IDS, POSITION_IDS} \
            else inputs
        if not (isinstance(tokens, torch.Tensor) and tokens.dim() == 2 and isinstance(targets, torch.Tensor)
                and targets.shape == tokens.shape):
            raise UserError(f"dist.context_parallel = {dims.context_parallel}: cuts windows of token ids [B, T] "
                            "(or packed ones) and their targets (the text and tokens data), and these samples are "
                            "not; set --set dist.context_parallel=1")
        group: dist.ProcessGroup = dims.mesh[CP].get_group()
        return cut_batch(inputs, targets, dims.context_parallel, dims.coordinate(rank)[CP], group)

    def counted(self, inputs, dims: ParallelDims):
        """The cut's attention counting the keys' and values' elements this rank holds of its own, each forward (what
        the group all-gathers, and whose gradients it reduce-scatters)."""
        if not (self.on(dims) and isinstance(inputs, dict) and callable(inputs.get(ATTEND))):
            return inputs, lambda: 0
        attend = _Counted(inputs[ATTEND])
        return {**inputs, ATTEND: attend}, lambda: attend.elements

    def traffic(self, dims: ParallelDims, config: DistConfig, step: StepCost) -> list[Traffic]:
        """Every attention layer's keys and values all-gathered over the cp ranks in each forward (again where a block
        is recomputed) and their gradients reduce-scattered in backward, every pass: (C-1) x a rank's own a
        collective. Its ranks are tp apart (the cp mesh dimension is tp's outer neighbour)."""
        if not self.on(dims):
            return []
        size, inner = dims.context_parallel, dims.tensor_parallel
        return [Traffic(CP, kind, *group_split(size, inner, step.per_node, own * size * step.passes, 1))
                for kind, own in zip(("all-gather", "reduce-scatter"), step.counted_bytes) if own]

    def loss_count(self, count: int, dims: ParallelDims) -> int:
        """Each rank backwards 1/C of the targets its micro-batch counts whole: C shares of the loss a rank."""
        return count * dims.context_parallel


def _decoder_stages(model: nn.Module) -> bool:
    """Whether the model is a transformers decoder whose pipeline stages read the step's positions and attention (a
    stage is handed the activations alone: distrib.distributed.step_inputs)."""
    from distrib.distributed.pipeline.decoder import stage_class  # the pipeline package imports the dimensions

    return stage_class(model) is not None


class _Counted:
    """The cut's attention (context_parallel.GatheredAttention) as the plan's forward runs it, counting the elements of
    the keys and values it is handed (this rank's own, before the gather)."""

    def __init__(self, attend):
        self.attend, self.elements = attend, 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.elements += k.numel() + v.numel()
        return self.attend(q, k, v, *args, **kwargs)

    def __getattr__(self, name: str):  # the rest of the attention's interface (its mask, its group), as it is
        return getattr(self.attend, name)
