"""Pipeline parallel (dist.pipeline_parallel > 1), composed with ddp, fsdp or hsdp on the data-parallel ranks of each
stage and with tensor parallel inside it: the model is built on meta, cut into stages (distrib.distributed.pipeline),
and each rank materialises only its own stages' shards, its blocks compiled first under speed.compile. A step runs
the schedule (GPipe, 1F1B, interleaved 1F1B); evaluation, the pre-flight batch and prediction run every stage in turn.

Every stage is FSDP2 over the stage's data-parallel ranks (ddp is FSDP2 replicating: a (replicate, shard 1) mesh),
so its state is DTensors saved shard by shard under the whole model's names: any layout reads the checkpoint."""

from __future__ import annotations

import contextlib
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from distrib.config import DistConfig
from distrib.distributed import fsdp
from distrib.distributed.compile import compile_blocks
from distrib.distributed.mesh import build_mesh, group_split
from distrib.distributed.parallel import clip_grad_norm, explain_device_errors, place_model
from distrib.distributed.pipeline import Pipeline, StageSplit, pipelined_view, split_stages, stages_of, view
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import materialise
from distrib.distributed.strategies.base import Build, StepLoss, strategy_named
from distrib.distributed.strategies.ddp import prepare
from distrib.distributed.strategies.fsdp import FSDPStrategy, _return_freed_memory_if_large
from distrib.distributed.tensor_parallel import apply_tensor_parallel
from distrib.errors import ConfigError, UserError


def _refuse(key: str, value, why: str, fix: str) -> NoReturn:
    raise ConfigError(f"dist.{key} = {value!r}: {why}; {fix}")


def _refuse_ties(model: nn.Module, stage_of: dict[str, int], pp: int) -> None:
    """A parameter shared by two stages (an output layer tied to the embedding) would need its gradients summed
    across them: refused, with the fix."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        other = first.setdefault(id(param), name)
        if other != name and _stage(stage_of, other) != _stage(stage_of, name):
            raise ConfigError(f"dist.pipeline_parallel = {pp}: {type(model).__name__} ties {name} to {other}, which "
                              "fall in different stages; untie them (the built-in GPT: --set "
                              "'model.kwargs={tie_weights = false}', with its other kwargs)")


def _stage(stage_of: dict[str, int], name: str) -> int | None:
    return next((stage for unit, stage in stage_of.items() if name.startswith(unit + ".")), None)


class PipelineStrategy(FSDPStrategy):
    names = ()  # chosen by dist.pipeline_parallel > 1, over the data-parallel strategy dist.strategy names
    sharded_state = True
    logs_extra_losses = False

    @classmethod
    def check_keys(cls, config: DistConfig) -> None:
        strategy_named(config.strategy).check_keys(config)  # the data-parallel strategy's rules hold in each stage
        schedule, per_rank = config.pipeline_schedule, config.stages_per_rank
        if schedule in ("zbv", "dualpipev"):
            # Measured: the built-in GPT at pp 2 (ddp or fsdp) trained to test loss 5.25 (zbv) and 4.068 (dualpipev)
            # after 12 steps where one process and every other schedule reach 4.0716: torch's split of the backward
            # into input and weight gradients does not give the same gradients here.
            _refuse("pipeline_schedule", schedule, "runs under torch 2.14 but does not train the same model as one "
                    "process (its split backward, measured on gloo: docs/parallelism.md, Pipeline parallelism)",
                    "use --set dist.pipeline_schedule=interleaved_1f1b (or 1f1b)")
        if schedule in ("gpipe", "1f1b") and per_rank != 1:
            _refuse("pipeline_stages_per_rank", per_rank, f"the {schedule} schedule runs one stage per rank",
                    "set --set dist.pipeline_schedule=interleaved_1f1b, or dist.pipeline_stages_per_rank=1")
        if schedule in ("zbv", "dualpipev") and per_rank != 2:
            _refuse("pipeline_stages_per_rank", per_rank, f"the {schedule} schedule runs two stages per rank, in a V",
                    "set --set dist.pipeline_stages_per_rank=2 (or 0)")
        if schedule == "interleaved_1f1b" and per_rank < 2:
            _refuse("pipeline_stages_per_rank", per_rank, "interleaved_1f1b interleaves several stages per rank",
                    "set --set dist.pipeline_stages_per_rank=2 (or 0), or dist.pipeline_schedule=1f1b")
        if config.cpu_offload:
            _refuse("cpu_offload", config.cpu_offload, "is not supported with dist.pipeline_parallel > 1 (each stage's "
                    "shards stay on its device)", "set --set dist.cpu_offload=false")
        if config.sync_batchnorm:
            _refuse("sync_batchnorm", config.sync_batchnorm, "is not supported with dist.pipeline_parallel > 1",
                    "set --set dist.sync_batchnorm=false")

    @classmethod
    def described(cls, config: DistConfig) -> str:
        return "dist.pipeline_parallel > 1"

    @classmethod
    def replicas_and_shards(cls, config: DistConfig, data_parallel: int, world_size: int,
                            local_world_size: int) -> tuple[int, int]:
        return strategy_named(config.strategy).replicas_and_shards(config, data_parallel, world_size,
                                                                   local_world_size)

    @property
    def stages(self) -> int:
        return self.dims.pipeline * self.config.stages_per_rank

    @property
    def microbatches(self) -> int:
        return self.config.pipeline_microbatches or self.stages

    def check_micro_batch(self, micro_batch_size: int) -> None:
        if micro_batch_size % self.microbatches:
            raise ConfigError(f"dist.pipeline_microbatches = {self.microbatches}: does not divide the micro-batch of "
                              f"{micro_batch_size} samples each data-parallel rank trains on per micro-step; use a "
                              f"divisor of {micro_batch_size}, or change train.global_batch_size")

    def setup_module(self, build: Build, runtime: Runtime) -> nn.Module:
        buffers, given = {}, build.given is not None
        if given:  # a module given to distrib.fit: whole on every rank already, each keeps its stages
            whole = place_model(build.given, runtime.device)
        elif build.load_weights is not None:
            whole, buffers = materialise.build_for_loading(build.factory, build.seed)
        else:
            whole = materialise.build_on_meta(build.factory, build.seed)
        _return_freed_memory_if_large(whole, runtime)
        self_init = not given and build.load_weights is None and materialise.initialises_itself(whole)
        self._names = list(whole.state_dict())  # the whole model's, in its order: what model.pt holds
        model = self._laid_out(whole, runtime, build.precision, runtime.device.type, build)
        if not given:
            self._materialise(model, runtime)
            if build.load_weights is not None:
                materialise.restore_buffers(model, buffers)
            elif self_init:  # the whole model's initialisation: this rank's tensors drawn as one process draws them
                materialise.init_shards(whole, build.seed)
            else:
                materialise.load_from_rank0(model, build.factory, build.seed, runtime, build.log)
        if build.load_weights is not None:
            build.load_weights(model)
        pipeline, config = model._pipeline, self.config
        build.log(f"pipeline parallel: {self.dims.pipeline} ranks x {config.stages_per_rank} stage(s) each, schedule "
                  f"{config.pipeline_schedule}, {self.microbatches} microbatches per micro-step; this rank holds "
                  f"{pipeline.describe()}: no rank held the model whole")
        return model

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the schedule's stages reduce their gradients after their last backward

    def forward_backward(self, model: nn.Module, micro_batches: list, step: StepLoss) -> torch.Tensor:
        pipeline: Pipeline = model._pipeline
        total = torch.zeros((), device=step.device)
        pieces = pipeline.microbatches
        for inputs, targets in micro_batches:
            if not isinstance(inputs, torch.Tensor):
                raise UserError("dist.pipeline_parallel > 1: the samples' inputs are not one tensor, and a pipeline "
                                "cuts one tensor into microbatches; use --set dist.pipeline_parallel=1")
            with explain_device_errors(model, step.device, step.batch(inputs, targets)), step.autocast():
                loss = pipeline.train_step(inputs, targets, lambda out, tgt: step.loss(out, tgt, pieces))
            if loss is not None:
                total = total + loss
        return total

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(model.parameters(), max_norm, across=model._pipeline.group)

    def after_forward_only(self, model: nn.Module) -> None:
        for stage in model._pipeline.stages.values():
            fsdp.reshard(stage)

    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, named: bool = False) -> dict:
        return fsdp.sharded_state(model, optimizer)

    def load_training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if not fsdp.keyed_by_name(state["optimizer"]):
            raise UserError("a one-file (ddp) checkpoint cannot be resumed under dist.pipeline_parallel > 1 (its "
                            "optimizer state is keyed by the whole model's parameter order); resume it under ddp or "
                            "fsdp once, then under pipeline parallel from that run's (sharded) checkpoint")
        fsdp.load_sharded_state(model, optimizer, state)

    def full_model_state(self, model: nn.Module) -> dict:
        return self.whole_on_rank0(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))

    def whole_on_rank0(self, state: dict) -> dict:
        """Each stage's first rank sends its whole tensors to rank 0, one at a time, point to point: rank 0 holds the
        whole state and one tensor in flight (gather_object held every rank's part pickled, padded to the largest:
        4x the model at world size 4 under pp 2)."""
        rank = dist.get_rank()
        first_of_stage = self.dims.data_rank(rank) == 0 and rank % self.dims.tensor_parallel == 0
        sends = first_of_stage and rank != 0
        # what each rank sends (name, shape, dtype; a value that is no tensor travels here), so rank 0 can receive it
        said = [(name, tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (name, None, t)
                for name, t in state.items()] if sends else []
        listed = [None] * dist.get_world_size()
        dist.all_gather_object(listed, said)
        on = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")  # where the group sends from
        if sends:
            for tensor in state.values():
                if isinstance(tensor, torch.Tensor):
                    dist.send(tensor.detach().to(on).contiguous(), dst=0)
        if rank != 0:
            return {}
        merged = {name: t.detach().cpu() if isinstance(t, torch.Tensor) else t for name, t in state.items()}
        for src, entries in enumerate(listed):
            for name, shape, kind in entries:  # kind: the dtype, or the value itself of what is no tensor
                if shape is None:
                    merged[name] = kind
                    continue
                received = torch.empty(shape, dtype=kind, device=on)
                dist.recv(received, src=src)
                merged[name] = received.cpu()
        return {name: merged[name] for name in self._names if name in merged}

    def complete(self, model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's names, in its order: this rank's tensors, and the other stages' as meta tensors of their
        shape (the weights files' layout is the same on every rank; a meta tensor is written by its own stage)."""
        whole = model._pipeline.whole.state_dict()
        return {name: tensors[name] if name in tensors else torch.empty(t.shape, dtype=t.dtype, device="meta")
                for name, t in whole.items()}

    def plan_module(self, model: nn.Module, runtime: Runtime, precision: str) -> nn.Module:
        """The stages of runtime.rank's pipeline rank, as setup_module splits, views and shards them (over distrib
        plan's fake group, whose own rank is 0: the data-parallel coordinates are rank 0's, the fullest shards)."""
        return self._laid_out(model, runtime, precision, "cpu")

    def _laid_out(self, whole: nn.Module, runtime: Runtime, precision: str, device_type: str,
                  build: Build | None = None) -> nn.Module:
        """runtime.rank's pipeline rank of `whole`, what the run trains and distrib plan sizes: the stages cut, this
        rank's as views, tensor parallel, compile (with a build: speed.compile), FSDP2 on each stage; `_pipeline`
        names them (a plain attribute: not a submodule, no state). device_type: the mesh's (plan's is the CPU)."""
        config, pp = self.config, self.dims.pipeline
        split = split_stages(whole, self.stages, config.pipeline_split, pp)
        _refuse_ties(whole, {unit: s for s in range(split.num_stages) for unit in split.stage_units(s)}, pp)
        if build is not None:
            prepare(whole, build.speed, config.shard_modules)
        mesh = build_mesh(self.dims, device_type)
        held, stage_views = rank_views(whole, split, self.dims.pipeline_rank(runtime.rank), pp, config)
        if self.dims.tensor_parallel > 1:  # first, so that FSDP shards the tensor-parallel slices over the others
            apply_tensor_parallel(held, mesh["tp"])
        if build is not None and build.speed.compile:  # torchtitan's order: tensor parallel, compile, FSDP
            build.log(compile_blocks(held, fsdp.find_blocks(held, config.shard_modules), build.speed))
        fsdp.shard(held, runtime, config, precision, mesh, roots=list(stage_views.values()))
        held.__dict__["_pipeline"] = Pipeline(split, stage_views, mesh["pp"].get_group(), pp,
                                              config.pipeline_schedule, self.microbatches, runtime.device, whole)
        return held

    def step_traffic(self, per_node: int, local_params: int, compute_bytes: int, grad_accum: int,
                     reshard_after_forward: bool, tp_activation_bytes: float = 0) -> tuple[float, float]:
        # Each stage's data-parallel traffic as fsdp's (the activations between stages: distrib.plan).
        return super().step_traffic(per_node, local_params, compute_bytes, grad_accum * self.microbatches,
                                    reshard_after_forward, tp_activation_bytes)


def rank_views(whole: nn.Module, split: StageSplit, pipeline_rank: int, pp: int, config: DistConfig
               ) -> tuple[nn.Module, dict[int, nn.Module]]:
    """A pipeline rank's stages as views of the whole model: all of them as one Pipelined module (what the optimizer
    and checkpoints see), and each stage's own view (an FSDP root, and the schedule's stage). distrib plan asks for
    any pipeline rank's, not only its own."""
    mine = stages_of(pipeline_rank, pp, config.stages_per_rank, config.pipeline_schedule)
    held = pipelined_view(whole, split.units, {unit for stage in mine for unit in split.stage_units(stage)})
    return held, {stage: view(whole, split.units, set(split.stage_units(stage))) for stage in mine}


__all__ = ["PipelineStrategy", "group_split", "rank_views"]
