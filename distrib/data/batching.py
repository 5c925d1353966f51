"""Batching: the world-size-invariant batch plan, evaluation batches, and the two batch sources (device-resident,
DataLoader) behind one protocol; both yield bitwise-identical batches for the same indices and epoch."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from distrib.config import DataConfig, TrainConfig, check_world_size
from distrib.data import samples
from distrib.data.augment import Augment
from distrib.data.samples import Tree
from distrib.data.tensors import Normalizer, Split
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError, UserError
from distrib.launch.preempt import ignore_stop_signals

Batch = tuple[Tree, Tree | None]  # (inputs, targets); a dict sample's targets are its "labels" (or None)


def init_worker(worker_id: int) -> None:
    """The worker_init_fn of every DataLoader. First, the objects its worker process inherited from the training
    process are frozen out of the garbage collector: the training process's garbage (a previous run's process group,
    kept by a reference cycle until a collection, as when one script calls distrib.fit twice) would otherwise be
    collected here, in a process without gloo's threads, whose destructor then hung or crashed the worker (measured:
    a Segmentation fault, or a rank that waited forever). Then the stop signals are ignored (ignore_stop_signals)."""
    gc.freeze()
    ignore_stop_signals(worker_id)


class BatchSource(Protocol):
    """Where batches come from. `batches` yields one (inputs, targets) pair on the runtime's device per index list, in
    order: images normalised to float32, any other inputs and all targets as the data gave them. `epoch` None means
    no augmentation (evaluation, prediction);
    otherwise augmentation is keyed by (seed, epoch, sample index), so both sources give bitwise-equal batches at
    any world size and after a resume."""

    num_samples: int | None  # None: a stream, whose length is unknown until a pass ends (distrib.data.stream)

    def batches(self, index_lists: list[torch.Tensor], epoch: int | None = None) -> Iterator[Batch]: ...


class Indexed:
    """A map-style source's part of a checkpoint, the interface streams share (distrib.data.stream): the position
    is index arithmetic on (seed, epoch, step_in_epoch), which the progress holds, so the state names only the kind."""

    def state_dict(self) -> dict:
        return {"kind": "indexed"}

    def load_state_dict(self, state: dict | None) -> None:
        kind = (state or {}).get("kind", "indexed")  # a checkpoint from before data positions: indexed
        if kind != "indexed":
            raise UserError(f"checkpoint: its data position is of a {kind} source, this run reads indexed (map-style) "
                            "data; resume with the data it was taken with, or start afresh with a new run.dir")


def source_state(source: BatchSource) -> dict:
    """The training source's part of a checkpoint (every rank calls it: a stream gathers every rank's position)."""
    return (source if hasattr(source, "state_dict") else Indexed()).state_dict()


def load_source_state(source: BatchSource, state: dict | None) -> None:
    """A checkpoint's data position into the training source."""
    (source if hasattr(source, "load_state_dict") else Indexed()).load_state_dict(state)


# ---------------------------------------------------------------- the batch plan


@dataclass(frozen=True)
class BatchPlan:
    """Which samples this rank uses at each step. Every epoch has one permutation from (seed, epoch) shared by all
    ranks; global batch k is the same set of samples at any world size; each rank takes its contiguous slice.
    num_samples None: a stream (distrib.data.stream), whose global batch k is its samples [kG, (k+1)G)."""

    num_samples: int | None
    global_batch_size: int
    grad_accum_steps: int
    rank: int
    world_size: int
    seed: int

    def __post_init__(self):
        check_world_size(self.global_batch_size, self.grad_accum_steps, self.world_size)
        if self.num_samples is not None and self.steps_per_epoch == 0:
            raise ConfigError(f"train.global_batch_size = {self.global_batch_size}: larger than the training set "
                              f"({self.num_samples} samples); use at most {self.num_samples}")

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // (self.world_size * self.grad_accum_steps)

    @property
    def steps_per_epoch(self) -> int | None:
        if self.num_samples is None:
            return None  # a stream: known when a pass ends
        return self.num_samples // self.global_batch_size  # the last partial global batch is dropped

    def order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def micro_batches(self, order: torch.Tensor, step_in_epoch: int) -> list[torch.Tensor]:
        """This rank's grad_accum_steps index tensors for one optimizer step; O(1), no replay of earlier steps."""
        per_rank = self.global_batch_size // self.world_size
        start = step_in_epoch * self.global_batch_size + self.rank * per_rank
        return list(order[start:start + per_rank].split(self.micro_batch_size))


def make_plan(num_samples: int | None, train: TrainConfig, runtime: Runtime,
              dims: ParallelDims | None = None) -> BatchPlan:
    """This rank's share of every global batch: its index on the batch mesh (the ranks of one tensor-parallel group,
    and a pipeline's stages, read the same micro-batches), in its fault-tolerant replica group; without dims every rank
    a replica."""
    dims = dims or ParallelDims.replicas(runtime.world_size)
    return BatchPlan(num_samples, train.global_batch_size, train.grad_accum_steps,
                     dims.batch_rank(runtime.rank, runtime.replica_group), dims.batch_ranks, train.seed)


def eval_batches(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """This rank's evaluation batches: the test set cut into fixed global batches, dealt out as contiguous runs.
    No padding and no duplicates, so ranks may get uneven shares; each sample sits in the same batch at any
    world size, so its logits are the same bits."""
    batches = list(torch.arange(num_samples).split(batch_size))
    lo, hi = rank * len(batches) // world_size, (rank + 1) * len(batches) // world_size
    return batches[lo:hi]


def epoch_steps(source: BatchSource, plan: BatchPlan, epoch: int, start_step: int = 0) -> Iterator[list[Batch]]:
    """This rank's micro-batches for each remaining step of `epoch`, starting at `start_step` without replay. A
    stream's pass runs until the stream ends (on any rank: every rank stops at the same step)."""
    if plan.num_samples is None:
        yield from source.steps(plan, epoch, start_step)
        return
    order = plan.order(epoch)
    steps = range(start_step, plan.steps_per_epoch)
    batches = source.batches([idx for step in steps for idx in plan.micro_batches(order, step)], epoch)
    for _ in steps:
        yield [next(batches) for _ in range(plan.grad_accum_steps)]


# ---------------------------------------------------------------- the two batch sources


class Finish:
    """What both sources do once a batch is on the device: augment (training), then normalise."""

    def __init__(self, normalizer: Normalizer, augment: Augment | None):
        self.normalizer, self.augment = normalizer, augment

    def __call__(self, inputs: Tree, targets: Tree | None, idx: torch.Tensor, epoch: int | None) -> Batch:
        if epoch is not None and self.augment is not None:
            inputs = self.augment(inputs, idx, epoch)
        return samples.resolve(self.normalizer(inputs), targets)


class DeviceBatches(Indexed):
    """The whole split moved to the device once (uint8 images stay uint8); batches are sliced by index there."""

    def __init__(self, split: Split, runtime: Runtime, normalizer: Normalizer | None = None,
                 augment: Augment | None = None):
        self.split = Split(samples.to_device(split.inputs, runtime.device),
                           samples.to_device(split.targets, runtime.device))
        self.device = runtime.device
        self.num_samples = len(split)
        self.finish = Finish(normalizer or _default_normalizer(split), augment)

    def batches(self, index_lists: list[torch.Tensor], epoch: int | None = None) -> Iterator[Batch]:
        if not index_lists:
            return
        # One copy of all the indices: from pageable memory, a copy per step would wait for the device's queue.
        indices = torch.cat(index_lists).to(self.device, non_blocking=True)
        for idx in indices.split([len(i) for i in index_lists]):
            yield self.finish(*self.split.rows(idx), idx, epoch)


def _default_normalizer(split: Split) -> Normalizer:
    """Without a DataInfo (tests, scripts): uint8 images in Fashion-MNIST's units, other inputs as given."""
    from distrib.data.tensors import FASHION_MNIST_STATS

    if not samples.is_image(split.inputs, per_sample=False):
        return Normalizer((), (), uint8=False)
    uint8 = split.inputs.dtype == torch.uint8
    return Normalizer(*(FASHION_MNIST_STATS if uint8 else ((0.0,), (1.0,))), uint8)


class InMemory(Dataset):
    """A Split as a Dataset that gathers a whole batch at once (one index_select instead of one call per sample)."""

    def __init__(self, split: Split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitems__(self, indices):
        return self.split.rows(torch.as_tensor(indices))  # whole rows


class Failed:
    """A sample that could not be loaded (in a DataLoader worker): the main process raises its message."""

    def __init__(self, message: str):
        self.message = message


def collate(batch):
    """A batch gathered whole (InMemory) passes through; samples are stacked (a dict sample's targets stay inside it,
    as None beside it); any failure is passed on."""
    if isinstance(batch, tuple):
        return batch
    failed = next((item for item in batch if isinstance(item, Failed)), None)
    if failed is not None:
        return failed
    pairs = [samples.as_pair(item) for item in batch]
    if any(pair is None for pair in pairs):
        bad = next(item for item, pair in zip(batch, pairs) if pair is None)
        return Failed(f"data: a sample is a {type(bad).__name__}; fix: make every sample (inputs, targets), each a "
                      "tensor or a dict of tensors, or one dict of tensors")
    kinds = {(samples.kind(x, rows=True), samples.kind(y, rows=True)) for x, y in pairs}
    if len(kinds) > 1:
        shown = sorted(f"{x} -> {y}" for x, y in kinds)[:3]
        return Failed(f"data: samples of different shapes or types in one batch ({'; '.join(shown)}); fix: give "
                      "samples of one shape (pad or cut sequences to one length)")
    inputs = samples.stack([x for x, _ in pairs])
    if isinstance(batch[0], dict):
        return inputs, None  # the labels are in the dict
    return inputs, samples.stack([y for _, y in pairs])


class _Lists(Sampler):
    """The batch sampler: this rank's index lists of the current call, set before each pass over the loader."""

    def __init__(self):
        self.lists: list[list[int]] = []

    def __iter__(self):
        return iter(self.lists)

    def __len__(self):
        return len(self.lists)


class LoaderBatches(Indexed):
    """A DataLoader for data that stays on the host (file-backed sets, or sets too big for the device): the same
    indices as the device path, loaded by data.num_workers processes, then finished on the device."""

    def __init__(self, dataset: Dataset, runtime: Runtime, num_workers: int = 0, normalizer: Normalizer | None = None,
                 augment: Augment | None = None, config: DataConfig | None = None, collate_fn=None):
        if isinstance(dataset, Split):
            normalizer = normalizer or _default_normalizer(dataset)
            dataset = InMemory(dataset)
        config = config or DataConfig()
        self.device = runtime.device
        self.num_samples = len(dataset)
        self.finish = Finish(normalizer, augment)
        self.sampler = _Lists()
        pin = config.pin_memory and runtime.pin_memory
        extra = dict(persistent_workers=config.persistent_workers, prefetch_factor=config.prefetch_factor)
        self.loader = DataLoader(dataset, batch_sampler=self.sampler, collate_fn=collate_fn or collate,
                                 num_workers=num_workers, pin_memory=pin, worker_init_fn=init_worker,
                                 **(extra if num_workers else {}))

    def batches(self, index_lists: list[torch.Tensor], epoch: int | None = None) -> Iterator[Batch]:
        if not index_lists:
            return
        self.sampler.lists = [idx.tolist() for idx in index_lists]
        indices = torch.cat(index_lists).to(self.device, non_blocking=True)
        for idx, batch in zip(indices.split([len(i) for i in index_lists]), self.loader):
            if isinstance(batch, Failed):
                raise UserError(batch.message)
            inputs, targets = (samples.to_device(part, self.device, non_blocking=True) for part in batch)
            yield self.finish(inputs, targets, idx, epoch)
