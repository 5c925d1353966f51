"""The data-parallel degrees' declaration (dist.strategy, dist.shard_size, dist.cpu_offload): the ranks that read
different micro-batches, holding the state whole and replicated (ddp: DDP over `replicate`) or in shards (fsdp:
FSDP2 over `shard`; hsdp: shard groups replicated over `replicate`). Their rules, their mesh dimensions, their
words, their step in parallelize (the last: the wrapper's hooks go around everything the other steps did) and their
traffic. How many replicas and shards a world holds is the strategy's (Strategy.replicas_and_shards)."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distrib.config import Config, SpeedConfig
from distrib.distributed import fsdp
from distrib.distributed.compile import compile_blocks, compile_whole
from distrib.distributed.dimensions.base import (
    DATA_PARALLEL,
    Dimension,
    Layout,
    Mesh,
    StepCost,
    Traffic,
    Words,
    group_split,
)
from distrib.distributed.dimensions.pipeline import microbatches as pipeline_microbatches
from distrib.distributed.mesh import EP, REPLICATE, SHARD, SHARD_MOD_EP, ParallelDims
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError


def wrap_ddp(model: nn.Module, runtime: Runtime, **options) -> DDP:
    """DDP over a model already on the worker's device; rank 0's initial weights are broadcast to all ranks."""
    return DDP(model, device_ids=runtime.ddp_device_ids, **options)


def replicate(model: nn.Module, runtime: Runtime, speed: SpeedConfig, log: Callable[[str], None] = lambda line: None,
              find_unused_parameters: bool = False) -> nn.Module:
    """DDP over a placed whole model, then torch.compile over it (compile_whole, whose line goes to `log`)."""
    wrapped = wrap_ddp(model, runtime, gradient_as_bucket_view=speed.gradient_as_bucket_view,
                       static_graph=speed.static_graph, bucket_cap_mb=speed.bucket_cap_mb or None,
                       find_unused_parameters=find_unused_parameters)
    if not speed.compile:
        return wrapped
    wrapped, line = compile_whole(wrapped, speed)
    log(line)
    return wrapped


def _gathers(dims: ParallelDims, config, step: StepCost) -> float:
    """How many times a step all-gathers the rank's parameters (counted in runs: scripts/bench_traffic.py): each
    forward and, resharded after it, each backward of every pass; under a pipeline each microbatch's forward and
    the first backward (the schedule keeps a stage's units gathered from then to the step's end), the units outside
    the blocks (a stage's root: never resharded after forward) once a micro-step."""
    again = config.reshard_after_forward
    if dims.pipeline == 1:
        return step.passes * (2 if again else 1)
    microbatches = pipeline_microbatches(config)
    blocks = (microbatches + 1) if again else 1
    return _reductions(dims, config, step) * ((1 - step.root_share) * blocks + step.root_share)


def _reductions(dims: ParallelDims, config, step: StepCost) -> int:
    """How many times a step reduces the gradients: once (FSDP2 skips the sync of all micro-steps but the last);
    under a pipeline each micro-step (its schedule reduces a stage's gradients after its last backward)."""
    return step.passes // pipeline_microbatches(config) if dims.pipeline > 1 else 1


def _sharded(name: str, size: int, inner: int, local: float, times: tuple[float, int],
             step: StepCost) -> list[Traffic]:
    """FSDP2's all-gathers (in the compute dtype) and fp32 reduce-scatters, (gathers, reductions) times a step, of
    the `local` parameters a rank holds in shards over a group of `size` ranks `inner` apart."""
    gathered, (gathers, reductions) = local * size, times
    return [Traffic(name, "all-gather", *group_split(size, inner, step.per_node, gathered * step.compute_bytes,
                                                     gathers)),
            Traffic(name, "reduce-scatter", *group_split(size, inner, step.per_node, gathered * 4, reductions))]


class DataParallel(Dimension):
    name = "data parallel"
    keys = ("strategy", "shard_size", "cpu_offload")
    step_at = DATA_PARALLEL

    def on(self, dims: ParallelDims) -> bool:
        return True  # every run has its data-parallel ranks, if only one

    def check(self, config: Config) -> None:
        dist = config.dist
        if dist.cpu_offload and dist.strategy == "ddp":
            raise ConfigError(f"dist.cpu_offload = {dist.cpu_offload}: offloads FSDP shards, and dist.strategy is "
                              "ddp; set --set dist.strategy=fsdp or --set dist.cpu_offload=false")
        if dist.shard_size and dist.strategy != "hsdp":
            raise ConfigError(f"dist.shard_size = {dist.shard_size}: sizes hsdp's shard groups, and dist.strategy "
                              f"is {dist.strategy}; set --set dist.strategy=hsdp or --set dist.shard_size=0")

    def mesh_dims(self, dims: ParallelDims, mesh: Mesh) -> Mesh:
        # FSDP2 replicates over a leading dimension and shards over the last (shard possibly 1: ddp's pipeline
        # stages); DDP's is (replicate)
        if not dims.fully_shard:
            return mesh + ((REPLICATE, dims.replicate),)
        return mesh + (((REPLICATE, dims.replicate),) if dims.replicate > 1 else ()) + ((SHARD, dims.shard),)

    def words(self, dims: ParallelDims, words: Words) -> Words:
        return words + tuple((name, f"{name} {size}") for name, size in self.mesh_dims(dims, ()))

    def parallelize(self, model: nn.Module, layout: Layout) -> nn.Module:
        speed, config = layout.speed, layout.config
        if not layout.dims.fully_shard:
            return replicate(model, layout.runtime, speed, layout.log, layout.find_unused_parameters)
        if speed.compile:  # blocks before fully_shard, so that FSDP's hooks stay outside the compiled graphs
            layout.log(compile_blocks(model, fsdp.find_blocks(model, config.shard_modules), speed))
        return fsdp.shard(model, layout.runtime, config, layout.precision, layout.dims.data_parallel_mesh(),
                          layout.roots, experts=layout.experts)

    def traffic(self, dims: ParallelDims, config, step: StepCost) -> list[Traffic]:
        """DDP: one all-reduce of the fp32 gradients, and its broadcast of the buffers before each forward (each rank
        passes them on once: a pipelined ring's). FSDP2: all-gathers of parameters (_gathers) and reduce-scatters of
        fp32 gradients (_reductions), over the shard dimension (its flattened pair under expert parallel; the
        experts over its rest), and over a replicate degree an all-reduce of the gradient shards."""
        per_node, local = step.per_node, step.local_params
        if not dims.fully_shard:
            buffers = step.buffer_bytes * step.passes if dims.replicate > 1 else 0
            within = per_node >= dims.replicate  # a group within a node
            return [Traffic(REPLICATE, "all-reduce", *group_split(dims.replicate, 1, per_node, local * 4, 2)),
                    Traffic(REPLICATE, "broadcast", buffers if within else 0, 0 if within else buffers)]
        inner = dims.tensor_parallel  # the ranks between two of a shard group's: a tensor-parallel group's
        experts = step.expert_params if dims.expert_parallel > 1 else 0
        times = _gathers(dims, config, step), _reductions(dims, config, step)
        name, shards = dims.shard_group()  # the mesh dimension FSDP2 shards over (a flattened one, maybe)
        name = f"{SHARD_MOD_EP}+{EP}" if name == SHARD and experts else name
        parts = _sharded(name, shards, inner, local - experts, times, step)
        if experts:  # each rank's experts over their shard group, ep x tp apart (those sharing tokens: as if so)
            parts += _sharded(*dims.expert_shard_group(), inner * dims.expert_parallel, experts, times, step)
        if dims.replicate > 1:
            parts.append(Traffic(REPLICATE, "all-reduce",
                                 *group_split(dims.replicate, shards * inner, per_node, local * 4, 2 * times[1])))
        return parts
