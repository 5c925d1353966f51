"""Where a model splits into pipeline stages, and one rank's stages as views of the one model built on meta.

A model is a sequence of units: the modules its forward runs one after the other. The built-in GPT declares them
(`_pipeline_units`: embeddings, every block, final norm, output), as a Hugging Face decoder does by its pipeline plan
(`_pp_plan`), and splits balanced by blocks; an nn.Sequential's units are its children, split where
dist.pipeline_split says. A stage keeps its units and drops the others: a container loses their keys, any other
module holds None there, which a pipeline-aware forward skips (the GPT's; a Hugging Face decoder's stage: decoder.py).
Parameter names stay the whole model's, so a checkpoint saved by stages loads into any other layout and back.

Views share the modules they keep with the model (and its root's parameters and buffers): one rank's stages are
one module for the optimizer, EMA and checkpoints (the Pipelined view: distrib.distributed.pipeline.stages), and each
stage is its own module for FSDP and the schedule. The whole model's other units stay on meta: what a rank's shards
are initialised alongside (drawing what one process draws), and what names the weights files' layout."""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from fnmatch import fnmatch

import torch.nn as nn

from distrib.errors import ConfigError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2P - 1 - r; the others loop: r, r + P, ...


# ---------------------------------------------------------------- where the model splits


def declared_units(model: nn.Module) -> tuple[str, ...]:
    """The unit patterns a model declares (`*` for any index): its `_pipeline_units`, or a Hugging Face model's
    pipeline plan (`_pp_plan`: its config's base_model_pp_plan under the base model's prefix, and the head's), a
    layer list as its blocks; () when it declares neither."""
    if getattr(model, "_pipeline_units", None):
        return tuple(model._pipeline_units)
    plan = getattr(model, "_pp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return ()
    # the plan's order is not the forward's (the head's entry comes first): the modules' own order is
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    modules = dict(model.named_modules())
    names = sorted((name for name in plan if name in order), key=order.__getitem__)
    return tuple(f"{name}.*" if isinstance(modules[name], nn.ModuleList) else name for name in names)


def pipeline_units(model: nn.Module) -> list[str] | None:
    """The modules the model's forward runs in order: its declared units (declared_units) expanded, or an
    nn.Sequential's children; None when the model says neither."""
    declared = declared_units(model)
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
                          "pipeline units (`_pipeline_units`, as the built-in GPT, or transformers' pipeline plan, "
                          "`base_model_pp_plan`, as Llama and Qwen2), so it cannot be cut into stages; "
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
    declared = declared_units(model)
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


def refuse_ties(model: nn.Module, split: StageSplit, pp: int) -> None:
    """A parameter shared by two stages (an output layer tied to the embedding) would need its gradients summed
    across them: refused, with the fix."""
    stage_of = {unit: stage for stage in range(split.num_stages) for unit in split.stage_units(stage)}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        other = first.setdefault(id(param), name)
        if other != name and _stage(stage_of, other) != _stage(stage_of, name):
            raise ConfigError(f"dist.pipeline_parallel = {pp}: {type(model).__name__} ties {name} to {other}, which "
                              "fall in different stages; untie them (the built-in GPT: --set "
                              "'model.kwargs={tie_weights = false}', with its other kwargs; a Hugging Face model: "
                              "tie_word_embeddings = false in its config)")


def _stage(stage_of: dict[str, int], name: str) -> int | None:
    return next((stage for unit, stage in stage_of.items() if name.startswith(unit + ".")), None)
