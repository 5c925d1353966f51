"""A Hugging Face checkpoint in the Hub's layout (per-expert tensors, older names) seen in a transformers model's own
layout through transformers' own checkpoint conversion (the transforms from_pretrained applies), for model.init_from.

The names and shapes come from running transformers' converters on meta tensors (nothing read); the load runs them on
the tensors each rank needs: where a converter stacks per-expert tensors into an experts-first one, only the experts
of the rank's block are read (its FSDP shard of the experts), else the group is read whole and the block sliced."""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn as nn

from distrib.checkpoint.blocks import block_slices, local_block, local_part
from distrib.errors import UserError


def transforms(model: nn.Module) -> list:
    """transformers' weight transforms for a transformers model (from_pretrained's list); [] for any other model."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    return get_model_conversion_mapping(model) if isinstance(model, PreTrainedModel) else []


class Group:
    """The source tensors one transformers WeightConverter turns into one or more of the model's tensors."""

    def __init__(self, converter, first: str):
        self.converter, self.first = converter, first  # first: the model's name of its first target
        self.sources: dict[str, list[str]] = {}  # the converter's source pattern -> source names, in natural order

    def convert(self, model: nn.Module, read) -> dict[str, torch.Tensor]:
        """{model name: tensor}, the converter run on read(source name, position in its list) (None: left out)."""
        converter = deepcopy(self.converter)
        for pattern, names in self.sources.items():
            for position, name in enumerate(names):
                converter.add_tensor(self.first, name, pattern, lambda at=name, index=position: read(at, index))
        done = converter.convert(self.first, model=model, config=getattr(model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in done.items()}

    def by_expert(self, length: int) -> bool:
        """Whether the converter stacks per-expert tensors along dim 0 (MergeModulelist(dim=0)), then at most joins
        them along another dim (Concatenate(dim >= 1)), every list holding one tensor per row of dim 0: then a
        block's rows of dim 0 are made from those experts alone."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        first, *rest = self.converter.operations
        return (isinstance(first, MergeModulelist) and first.dim == 0
                and all(isinstance(op, Concatenate) and op.dim >= 1 for op in rest)
                and all(len(names) == length for names in self.sources.values()))


class Converted:
    """A Safetensors or TorchFile source (distrib.checkpoint.init_from) under the model's names: .shapes, .path,
    .kind and .load(targets) as the source's."""

    def __init__(self, source, model: nn.Module, plain: dict[str, str], groups: dict[str, Group]):
        self.source, self.model, self.plain, self.groups = source, model, plain, groups
        self.path = source.path
        self.kind = f"{source.kind} in the Hub's layout, through transformers' checkpoint conversion"
        self.shapes = {name: source.shapes[original] for name, original in plain.items()}
        self.made: dict[str, str] = {}  # model name -> the group that makes it
        for first, group in groups.items():
            meta = group.convert(model, lambda name, position: torch.empty(source.shapes[name], device="meta"))
            self.shapes.update({name: tuple(tensor.shape) for name, tensor in meta.items()})
            self.made.update({name: first for name in meta})

    def load(self, targets: dict[str, torch.Tensor]) -> int:
        read = 0
        for first in dict.fromkeys(self.made[name] for name in targets if name in self.made):
            mine = {name: tensor for name, tensor in targets.items() if self.made.get(name) == first}
            read += self._load_group(self.groups[first], mine)
        return read + self.source.load({self.plain[name]: tensor for name, tensor in targets.items()
                                        if name in self.plain})  # last: it unmaps the files

    def _load_group(self, group: Group, targets: dict[str, torch.Tensor]) -> int:
        """This rank's blocks of one group's tensors: only its experts' rows where the converter allows it."""
        blocks = {name: local_block(tensor) for name, tensor in targets.items()}
        rows = _rows(blocks)
        if rows is not None and not len(rows):
            return 0  # an empty shard (dim 0 split unevenly over more ranks than rows): nothing to write
        by_expert = rows is not None and group.by_expert(next(iter(targets.values())).shape[0])
        read = [0]

        def fetch(name: str, position: int) -> torch.Tensor | None:
            if by_expert and position not in rows:
                return None  # another rank's expert: the converter stacks only this rank's
            tensor = self.source.read(name, ())
            read[0] += tensor.numel() * tensor.element_size()
            return tensor

        made = group.convert(self.model, fetch)
        with torch.no_grad():
            for name, (offsets, sizes) in blocks.items():
                if by_expert:  # dim 0 is already this block's rows
                    offsets = (0, *offsets[1:])
                local_part(targets[name]).copy_(made[name][block_slices(offsets, sizes)])
        return read[0]


def _rows(blocks: dict[str, tuple]) -> range | None:
    """The rows of dim 0 that every block of a group holds, when they agree (else None: the group is read whole)."""
    firsts = {(offsets[0], sizes[0]) if offsets else None for offsets, sizes in blocks.values()}
    if len(firsts) != 1 or None in firsts:
        return None
    start, size = firsts.pop()
    return range(start, start + size)


def converted(model: nn.Module, source, expected: set[str]):
    """The source seen through the model's transformers conversion when it renames or converts any of its names
    (a Mixtral saved by save_pretrained: block_sparse_moe.experts.N.w1/w2/w3 -> mlp.experts.gate_up_proj and
    down_proj), else the source itself. expected: the model's names (a name it has is never renamed, as
    from_pretrained)."""
    if not hasattr(source, "read"):
        return source  # a sharded distrib checkpoint: the model's own names
    found = transforms(model)
    if not found:
        return source
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [t for t in found if isinstance(t, WeightRenaming)]
    converters = [t for t in found if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    plain, groups = {}, {}
    for original in sorted(source.shapes, key=dot_natural_key):  # a converter's lists in expert order
        name, pattern = rename_source_key(original, renamings, converters)
        if original in expected and name not in expected:
            name, pattern = original, None
        if pattern is None:
            plain[name] = original
        else:
            group = groups.setdefault(name, Group(by_pattern[pattern], name))
            group.sources.setdefault(pattern, []).append(original)
    if not groups and all(name == original for name, original in plain.items()):
        return source
    try:
        return Converted(source, model, plain, groups)
    except Exception as e:  # noqa: BLE001 - any op of transformers' on tensors that do not fit it
        raise UserError(f"model.init_from = {str(source.path)!r}: transformers' checkpoint conversion of "
                        f"{type(model).__name__} does not apply to these weights ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]}); give the weights of this model") from None
