"""Pipeline parallel's mechanics (dist.pipeline_parallel): the model cut by depth into stages, each rank's stages as
views of the one model built on meta, a forward through every stage for evaluation and the pre-flight batch, and
torch's schedules (torch.distributed.pipelining) for training.

A model is a sequence of units: the modules its forward runs one after the other. The built-in GPT declares them
(`_pipeline_units`: embeddings, every block, final norm, output) and splits balanced by blocks; an nn.Sequential's
units are its children, split where dist.pipeline_split says. A stage keeps its units and drops the others: a
container loses their keys, any other module holds None there, which a pipeline-aware forward skips (the GPT's).
Parameter names stay the whole model's, so a checkpoint saved by stages loads into any other layout and back.

Views share the modules they keep with the model (and its root's parameters and buffers): one rank's stages are
one module for the optimizer, EMA and checkpoints (the Pipelined view), and each stage is its own module for FSDP and
the schedule. The whole model's other units stay on meta: what a rank's shards are initialised alongside (drawing
what one process draws), and what names the weights files' layout."""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections import OrderedDict
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from distrib.errors import ConfigError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
              "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
_V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2P - 1 - r; the others loop: r, r + P, ...


# ---------------------------------------------------------------- where the model splits


def pipeline_units(model: nn.Module) -> list[str] | None:
    """The modules the model's forward runs in order: its declared `_pipeline_units` (patterns, `*` for any index)
    expanded, or an nn.Sequential's children; None when the model says neither."""
    declared = getattr(model, "_pipeline_units", None)
    if declared:
        names = [name for name, _ in model.named_modules() if name]
        return [name for pattern in declared for name in names if fnmatch(name, pattern) and "." not in
                name[len(pattern.rstrip("*")):]]
    if isinstance(model, nn.Sequential):
        return list(model._modules)
    return None


@dataclass(frozen=True)
class StageSplit:
    """units: every unit in order; starts: the index of each stage's first unit."""

    units: tuple[str, ...]
    starts: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.starts)

    def stage_units(self, stage: int) -> tuple[str, ...]:
        end = self.starts[stage + 1] if stage + 1 < self.num_stages else len(self.units)
        return self.units[self.starts[stage]:end]

    def describe(self, stage: int) -> str:
        units = self.stage_units(stage)
        return units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]}"


def _balanced(units: list[str], blocks: list[str], num_stages: int) -> tuple[int, ...]:
    """Stage starts that give each stage an equal share of the blocks (the first stages one more where they do not
    divide); what comes before the first block goes with the first stage, after the last with the last."""
    first = [blocks[round(stage * len(blocks) / num_stages)] for stage in range(num_stages)]
    return (0, *(units.index(name) for name in first[1:]))


def split_stages(model: nn.Module, num_stages: int, split: tuple[str, ...], pp: int) -> StageSplit:
    """Where the model splits into num_stages stages: at dist.pipeline_split's names, else balanced by the blocks a
    model declares; a one-line ConfigError for a model that cannot be split so."""
    name = type(model).__name__
    units = pipeline_units(model)
    stages = f"dist.pipeline_parallel = {pp} x {num_stages // pp} stage(s) per rank = {num_stages} stages"
    if units is None:
        raise ConfigError(f"dist.pipeline_parallel = {pp}: {name} is neither an nn.Sequential nor declares its "
                          "pipeline units (`_pipeline_units`, as the built-in GPT), so it cannot be cut into stages; "
                          "give it as an nn.Sequential of its layers with --set 'dist.pipeline_split=[...]', or use "
                          "--set dist.pipeline_parallel=1")
    if split:
        unknown = [s for s in split if s not in units]
        if unknown:
            listed = ", ".join(units[:12]) + (", ..." if len(units) > 12 else "")
            raise ConfigError(f"dist.pipeline_split = {list(split)}: {unknown[0]!r} is not one of {name}'s pipeline "
                              f"units ({listed}); name the units that start stages 2, 3, ...")
        if len(split) != num_stages - 1:
            raise ConfigError(f"dist.pipeline_split = {list(split)}: {len(split)} names make {len(split) + 1} stages, "
                              f"and {stages}; give {num_stages - 1} names")
        starts = (0, *(units.index(s) for s in split))
        if list(starts) != sorted(set(starts)) or starts[1:2] == (0,):
            raise ConfigError(f"dist.pipeline_split = {list(split)}: the names must follow the model's order "
                              f"({', '.join(units[:12])}), each after the one before, none the first unit")
        return StageSplit(tuple(units), starts)
    blocks = [u for u, pattern in _expanded(model, units) if "*" in pattern]
    if not blocks:
        raise ConfigError(f"dist.pipeline_parallel = {pp}: {name} has no pipeline split of its own; name the modules "
                          f"that start stages 2, 3, ... with --set 'dist.pipeline_split=[...]' (its units: "
                          f"{', '.join(units[:12])}{', ...' if len(units) > 12 else ''})")
    if len(blocks) < num_stages:
        raise ConfigError(f"{stages}: more than {name}'s {len(blocks)} blocks; use fewer stages (at most "
                          f"{len(blocks)}), or a deeper model")
    return StageSplit(tuple(units), _balanced(units, blocks, num_stages))


def _expanded(model: nn.Module, units: list[str]) -> list[tuple[str, str]]:
    """(unit, the declared pattern it came from); an nn.Sequential's units came from no pattern."""
    declared = getattr(model, "_pipeline_units", None) or ()
    return [(unit, next((p for p in declared if fnmatch(unit, p)), unit)) for unit in units]


def stages_of(pipeline_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The stages a pipeline rank holds, in order: looped (r, r + P, ...) or, for the V schedules, r and 2P - 1 - r."""
    if schedule in _V_SHAPED:
        return [pipeline_rank, 2 * pp - 1 - pipeline_rank]
    return [pipeline_rank + k * pp for k in range(per_rank)]


def owner_of(stage: int, pp: int, schedule: str) -> int:
    if schedule in _V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


# ---------------------------------------------------------------- views of the model


def _fresh(module: nn.Module, cls: type | None = None) -> nn.Module:
    """A shallow copy of a module: the same parameters, buffers and child objects (shared dictionaries for the
    tensors, so materialising or sharding through one view shows in all), hooks and children its own to change."""
    twin = object.__new__(cls or type(module))
    twin.__dict__ = {key: (copy.copy(value) if "hook" in key and isinstance(value, dict) else value)
                     for key, value in module.__dict__.items()}
    twin._modules = OrderedDict(module._modules)
    return twin


def view(model: nn.Module, units: tuple[str, ...], keep: set[str], cls: type | None = None) -> nn.Module:
    """The model with only the units in `keep`: the others dropped from their container, or None in their parent."""
    drop = [u for u in units if u not in keep]
    root = _fresh(model, cls)
    for unit in drop:
        parent_name, _, child = unit.rpartition(".")
        parent = root
        if parent_name:  # copy the path down to the unit's parent, so the model itself keeps it
            module = root
            for part in parent_name.split("."):
                module._modules[part] = _fresh(module._modules[part])
                module = module._modules[part]
            parent = module
        if isinstance(parent, _CONTAINERS):
            del parent._modules[child]  # the other keys stay: the parameter names stay the model's
        else:
            parent._modules[child] = None
    return root


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
    """This rank's part of the pipeline: its stages (views), the group of its stage ranks, and the schedule."""

    split: StageSplit
    stages: dict[int, nn.Module]  # stage index -> its view (an FSDP root once sharded)
    group: dist.ProcessGroup
    pp: int
    schedule_name: str
    microbatches: int
    device: torch.device
    whole: nn.Module  # the whole model: this rank's units real, the others on meta
    schedule: object = None  # built at the first step (torch's stages infer their shapes from the first batch)
    loss_of: Callable | None = field(default=None, repr=False)  # (output, target) -> loss, set for each step

    @property
    def has_first(self) -> bool:
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        return self.split.num_stages - 1 in self.stages

    def rank_of(self, stage: int) -> int:
        return dist.get_global_rank(self.group, owner_of(stage, self.pp, self.schedule_name))

    def describe(self) -> str:
        return ", ".join(f"stage {s} ({self.split.describe(s)})" for s in self.stages)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Every stage in turn, each on the rank that holds it, activations sent to the next; the last stage's
        output broadcast to every stage rank. A collective of the stage ranks: all call it with the same inputs."""
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
        from torch.distributed.pipelining import PipelineStage, schedules

        staged = [PipelineStage(module, index, self.split.num_stages, self.device, group=self.group)
                  for index, module in sorted(self.stages.items())]
        cls = getattr(schedules, _SCHEDULES[self.schedule_name])
        multi = issubclass(cls, schedules.PipelineScheduleMulti)
        # scale_grads=False: the loss is normalised once, by the trainer's step loss (each microbatch's share).
        return cls(staged if multi else staged[0], n_microbatches=self.microbatches,
                   loss_fn=lambda output, target: self.loss_of(output, target), scale_grads=False)


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

    def forward(self, *args, **kwargs):
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise TypeError("under dist.pipeline_parallel the model takes one tensor (token ids, images, features): "
                            "dict samples cannot be cut into microbatches and sent between stages")
        return self._pipeline.forward(args[0])


def pipelined_view(model: nn.Module, units: tuple[str, ...], keep: set[str]) -> nn.Module:
    """This rank's stages as a Pipelined module of the model's class name (its forward takes what the model's
    does, as the loss and the pre-flight checks read from the signature)."""
    base = type(model)
    cls = type(f"Pipelined{base.__name__}", (Pipelined,), {"__module__": base.__module__})
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
