"""The micro-batch the plan's passes and the dry run's step take: the training data's first samples as read, so that
they have its structure (a tensor, or a dict sample's input_ids and labels), dtypes and shapes, as meta or fake
tensors of a micro-batch's rows; and the token positions they hold."""

from __future__ import annotations

import torch

from distrib.data.batching import Batch, BatchSource
from distrib.data.samples import Tree
from distrib.distributed.step_inputs import handed_alone
from distrib.errors import ConfigError
from distrib.training.losses import describe


def first_samples(source: BatchSource, size: int) -> Batch:
    """The first `size` samples of the training data (of a stream: its first ones), as (inputs, targets): the
    structure a micro-batch has (padded micro-batches: the lengths of these samples)."""
    indices = torch.arange(min(size, source.num_samples or size))  # None: a stream
    return next(iter(source.batches([indices])))


def _like(tree: Tree | None, rows: int, device) -> Tree | None:
    """Each tensor of `tree` as zeros of `rows` rows on `device` (meta: nothing allocated; the host under a fake mode:
    fake tensors), in its dtype and shape."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {key: _like(value, rows, device) for key, value in tree.items()}
    return torch.zeros(rows, *tree.shape[1:], dtype=tree.dtype, device=device)


def shaped_batch(sample: Batch, rows: int, device="meta") -> Batch:
    """A micro-batch of `rows` samples shaped as `sample` (first_samples'), of zeros on `device`. A dict sample's
    targets are its labels, inside its inputs: the same tensor here too."""
    inputs = _like(sample[0], rows, device)
    if isinstance(inputs, dict) and sample[1] is not None and sample[1] is sample[0].get("labels"):
        return inputs, inputs["labels"]
    return inputs, _like(sample[1], rows, device)


def token_ids(inputs: Tree) -> torch.Tensor | None:
    """The micro-batch's token ids ([B, T] integers: the inputs, or a dict's input_ids), None for other inputs."""
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point() else None


def num_tokens(inputs: Tree) -> int:
    """The token ids a micro-batch holds (what its MoE layers route), 0 for inputs of other kinds."""
    ids = token_ids(inputs)
    return 0 if ids is None else ids.numel()


def positions(inputs: Tree) -> int:
    """The positions a micro-batch runs through a model: its tokens, or its samples (images, features)."""
    ids = token_ids(inputs)
    if ids is not None:
        return ids.numel()
    return len(next(iter(inputs.values())) if isinstance(inputs, dict) else inputs)


def staged_inputs(sample: Batch, pipeline_parallel: int) -> None:
    """Pipeline stages take one tensor of inputs (or packed documents' token ids, whose positions reach the stages
    from the step: distrib.distributed.pipeline.runner.one_tensor): a one-line refusal for others (as the run's first
    forward says)."""
    if not (isinstance(sample[0], torch.Tensor) or handed_alone(sample[0])):
        raise ConfigError(f"dist.pipeline_parallel = {pipeline_parallel}: the data's micro-batches are dict samples "
                          f"({describe(sample[0])}), which cannot be cut into microbatches and sent between stages; "
                          "fix: --set dist.pipeline_parallel=1, or samples of one tensor of inputs (token ids)")
