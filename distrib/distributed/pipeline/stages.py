"""One rank's part of the pipeline: its stages (views of the one model), the group of its stage ranks, torch's
schedule (torch.distributed.pipelining) for training, a forward through every stage in turn for forward-only passes
(evaluation, prediction, the pre-flight batch), and the whole state gathered from the stages on rank 0."""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.distributed.context_parallel import takes_attend
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.pipeline.decoder import stage_class
from distrib.distributed.pipeline.split import StageSplit, owner_of, view
from distrib.distributed.step_inputs import ATTEND, handed_alone, microbatch, stepping

_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
              "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}

# ---------------------------------------------------------------- point to point, for forwards without backward

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_HEADER = 10  # ndim, dtype, up to 8 sizes


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"a pipeline stage's output of shape {list(tensor.shape)} and {tensor.dtype} cannot be sent")
    sizes = list(tensor.shape) + [0] * (_HEADER - 2 - tensor.dim())
    return torch.tensor([tensor.dim(), _DTYPES.index(tensor.dtype), *sizes], dtype=torch.int64, device=tensor.device)


def _empty_like_header(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    ndim, dtype, *sizes = header.tolist()
    return torch.empty(sizes[:ndim], dtype=_DTYPES[dtype], device=device)


# ---------------------------------------------------------------- one rank's stages


@dataclass(eq=False)
class Pipeline:
    """This rank's part of the pipeline: its stages (views), the group of its stage ranks, and the schedule. Owned by
    the step runner (distrib.distributed.pipeline.runner); the Pipelined module that the optimizer and checkpoints see
    runs its forward through it."""

    split: StageSplit
    stages: dict[int, nn.Module]  # stage index -> its view (an FSDP root once sharded)
    group: dist.ProcessGroup
    dims: ParallelDims
    schedule_name: str
    microbatches: int
    device: torch.device
    whole: nn.Module  # the whole model: this rank's units real, the others on meta
    names: list[str] = field(default_factory=list)  # the whole model's state_dict keys, in order: what model.pt holds
    schedule: object = None  # built at the first step (torch's stages infer their shapes from the first batch)
    loss_of: Callable | None = field(default=None, repr=False)  # (output, target) -> loss, set for each step

    @property
    def has_first(self) -> bool:
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        return self.split.num_stages - 1 in self.stages

    @property
    def reads_positions(self) -> bool:
        """Whether the stages read the step's positions (distrib.distributed.step_inputs): the built-in GPT's (its
        forward takes `attend`) and a transformers decoder's (decoder.stage_class)."""
        return takes_attend(self.whole) or stage_class(self.whole) is not None

    def rank_of(self, stage: int) -> int:
        return dist.get_global_rank(self.group, owner_of(stage, self.dims.pipeline, self.schedule_name))

    def describe(self) -> str:
        return ", ".join(f"stage {s} ({self.split.describe(s)})" for s in self.stages)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Every stage in turn, each on the rank that holds it, activations sent to the next; the last stage's
        output broadcast to every stage rank. A collective of the stage ranks: all call it with the same inputs.
        (torch's schedule.eval would need every batch cut into this many microbatches, of the shape it was built
        for: evaluation's last batch and the pre-flight batch are not.)"""
        x = inputs
        last = self.split.num_stages - 1
        for stage in range(last + 1):
            if stage not in self.stages:
                continue
            if stage > 0 and self.rank_of(stage - 1) != dist.get_rank():
                x = self._recv(self.rank_of(stage - 1))
            with _naming_stage(stage, self):
                x = self.stages[stage](x)
            if stage < last and self.rank_of(stage + 1) != dist.get_rank():
                self._send(x, self.rank_of(stage + 1))
        src = self.rank_of(last)
        header = _header(x) if src == dist.get_rank() else torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=src, group=self.group)
        out = x.contiguous() if src == dist.get_rank() else _empty_like_header(header, self.device)
        dist.broadcast(out, src=src, group=self.group)
        return out

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(_header(tensor), dst=dst, group=self.group)
        dist.send(tensor.detach().contiguous(), dst=dst, group=self.group)

    def _recv(self, src: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src, group=self.group)
        tensor = _empty_like_header(header, self.device)
        dist.recv(tensor, src=src, group=self.group)
        return tensor

    def train_step(self, inputs, targets, loss_of: Callable) -> torch.Tensor | None:
        """One micro-step's forward and backward through the schedule; the sum of this rank's microbatch losses on
        the last stage's ranks, None on the others."""
        if self.schedule is None:
            self.schedule = self._build_schedule()
        self.loss_of, losses = loss_of, []
        args = (inputs,) if self.has_first else ()
        with _naming_stage(None, self):
            self.schedule.step(*args, target=targets if self.has_last else None, losses=losses,
                               return_outputs=False)
        return torch.stack(losses).sum().detach() if losses else None

    def _build_schedule(self):
        from torch.distributed.pipelining import schedules

        staged = [_stage_type()(module, index, self.split.num_stages, self.device, group=self.group)
                  for index, module in sorted(self.stages.items())]
        cls = getattr(schedules, _SCHEDULES[self.schedule_name])
        multi = issubclass(cls, schedules.PipelineScheduleMulti)
        # scale_grads=False: the loss is normalised once, by the trainer's step loss (each microbatch's share).
        return cls(staged if multi else staged[0], n_microbatches=self.microbatches,
                   loss_fn=lambda output, target: self.loss_of(output, target), scale_grads=False)

    def whole_on_rank0(self, state: dict) -> dict:
        """Each stage's first rank sends its whole tensors to rank 0, one at a time, point to point: rank 0 holds the
        whole state and one tensor in flight (gather_object held every rank's part pickled, padded to the largest:
        4x the model at world size 4 under pp 2). A collective of every rank."""
        rank = dist.get_rank()
        sends = self.dims.leads_stage(rank) and rank != 0
        # what each rank sends (name, shape, dtype; a value that is no tensor travels here), so rank 0 can receive it
        said = [(name, tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (name, None, t)
                for name, t in state.items()] if sends else []
        listed = [None] * dist.get_world_size()
        dist.all_gather_object(listed, said)
        if sends:
            for tensor in state.values():
                if isinstance(tensor, torch.Tensor):
                    dist.send(tensor.detach().to(self.device).contiguous(), dst=0)
        if rank != 0:
            return {}
        merged = {name: t.detach().cpu() if isinstance(t, torch.Tensor) else t for name, t in state.items()}
        for src, entries in enumerate(listed):
            for name, shape, kind in entries:  # kind: the dtype, or the value itself of what is no tensor
                if shape is None:
                    merged[name] = kind
                    continue
                received = torch.empty(shape, dtype=kind, device=self.device)
                dist.recv(received, src=src)
                merged[name] = received.cpu()
        return {name: merged[name] for name in self.names if name in merged}

    def complete(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's names, in its order: this rank's tensors, and the other stages' as meta tensors of their
        shape (the weights files' layout is the same on every rank; a meta tensor is written by its own stage)."""
        whole = self.whole.state_dict()
        return {name: tensors[name] if name in tensors else torch.empty(t.shape, dtype=t.dtype, device="meta")
                for name, t in whole.items()}


@functools.cache
def _stage_type() -> type:
    """torch's PipelineStage, its forwards run as the schedule's microbatch (the step's rows: step_inputs)."""
    from torch.distributed.pipelining import PipelineStage

    class MicrobatchStage(PipelineStage):
        def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
            with microbatch(fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    return MicrobatchStage


@contextlib.contextmanager
def _naming_stage(stage: int | None, pipeline: Pipeline) -> Iterator[None]:
    """A device mismatch inside a stage names the stage and what it holds."""
    from distrib.distributed.parallel import _MISMATCH_PHRASES

    try:
        yield
    except RuntimeError as e:
        if not any(phrase in str(e) for phrase in _MISMATCH_PHRASES):
            raise
        where = f"pipeline stage {stage} ({pipeline.split.describe(stage)})" if stage is not None else \
            f"pipeline {pipeline.describe()}"
        raise type(e)(f"{where}: {e}") from e


class Pipelined(nn.Module):
    """One rank's stages as one module: the parameters, buffers and names of the units they hold (what the optimizer,
    the EMA and checkpoints see), and a forward that runs the whole pipeline (Pipeline.forward, a collective of the
    stage ranks) for evaluation, prediction and the pre-flight batch."""

    pipeline: Pipeline | None = None  # handed over by the step runner that owns it, once the stages are sharded

    def forward(self, *args, **kwargs):
        kwargs.pop("use_cache", None)  # distrib's loss asks a transformers model for none with packed documents
        if not args and handed_alone(kwargs) and ATTEND not in kwargs and self.pipeline.reads_positions:
            with stepping(kwargs) as tokens:  # packed documents: their positions reach every stage
                return self.pipeline.forward(tokens)
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise TypeError("under dist.pipeline_parallel the model takes one tensor (token ids, images, features): "
                            "dict samples cannot be cut into microbatches and sent between stages")
        return self.pipeline.forward(args[0])


def pipelined_view(model: nn.Module, units: tuple[str, ...], keep: set[str]) -> nn.Module:
    """This rank's stages as a Pipelined module of the model's class name (its forward takes what the model's
    does, as the loss and the pre-flight checks read from the signature; whole_class is the model's class, what the
    weights' config.json names)."""
    base = type(model)
    cls = type(f"Pipelined{base.__name__}", (Pipelined,), {"__module__": base.__module__, "whole_class": base})
    signature = inspect.signature(base.forward)
    cls.forward = _with_signature(Pipelined.forward, signature)
    for name in ("_no_split_modules", "_tp_plan", "_pipeline_units"):
        if hasattr(base, name):
            setattr(cls, name, getattr(base, name))
    return view(model, units, keep, cls)


def _with_signature(function, signature):
    def forward(self, *args, **kwargs):
        return function(self, *args, **kwargs)

    forward.__signature__ = signature
    return forward
