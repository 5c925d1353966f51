"""Streams as a training source: an IterableDataset (plain: it knows nothing of ranks or workers) or a source that
knows its shards (a Hugging Face datasets.IterableDataset, distrib.data.Shards), read pass by pass through
DataLoader workers (distrib.data.stream_read), with each rank's position in a checkpoint and every rank stopping at
the same step when a pass ends.

Plain streams give the same global batches at any world size (every rank reads the whole stream and keeps its
slice); sharded streams give each rank its own shards (no rank reads the whole stream), so their batches depend on
the world size, and a checkpoint resumes at the world size and data.num_workers it was taken with."""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from distrib.config import DataConfig
from distrib.data import samples
from distrib.data.batching import Batch, BatchPlan, Failed, Finish, collate, init_worker
from distrib.data.stream_read import Item, Layout, StreamCollate, WorkerStream, head, identity, kinds_of
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError

OK, DRY, FAILED = 1, 0, -1  # a rank's vote on the next step (the all-reduce keeps the smallest)


def is_stream(value) -> bool:
    return isinstance(value, IterableDataset)


def is_sharded(value) -> bool:
    """Sources that know their shards: Hugging Face's IterableDataset, distrib.data.Shards."""
    return isinstance(getattr(value, "n_shards", None), int) and callable(getattr(value, "shard", None))


def _hugging_face(source) -> bool:
    return type(source).__module__.startswith("datasets.")


def describe(source, world_size: int) -> str:
    """How the ranks read a training stream, for the data line of the log."""
    if not is_sharded(source):
        return "plain (every rank reads it whole)"
    shards = source.n_shards
    if shards % world_size == 0:
        return f"sharded ({shards} shards: each rank reads its own)"
    if _hugging_face(source):  # its own rule
        return (f"sharded ({shards} shards, which do not divide among {world_size} ranks: each rank reads them all "
                f"and keeps 1 of {world_size} samples; give a multiple of {world_size} shards)")
    return f"sharded ({shards} shards, dealt out unevenly to {world_size} ranks)"


def rank_part(source, rank: int, world_size: int):
    """This rank's part of a sharded source (a Hugging Face dataset whose shards do not divide among the ranks is
    read by every rank, each keeping 1 of world_size samples: its own rule)."""
    if world_size == 1:
        return source
    if _hugging_face(source):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(source, rank=rank, world_size=world_size)
    return source.shard(num_shards=world_size, index=rank)


class WorkerOrder:
    """The micro-batches of every worker in one order, whatever order the DataLoader delivers them in: round robin
    over the workers, skipping those that ended. Keeps each worker's position after its last micro-batch taken."""

    def __init__(self, items: Iterator[Item], num_workers: int, start: dict):
        self.items, self.num_workers = items, num_workers
        self.next_worker, self.done = start.get("next", 0), set(start.get("done", ()))
        self.states = {int(w): s for w, s in start.get("workers", {}).items()}
        self.waiting: dict[int, deque] = {w: deque() for w in range(num_workers)}
        self.ends: list[Item] = []

    def next(self) -> Item | None:
        while len(self.done) < self.num_workers:
            worker = self.next_worker
            if worker in self.done:
                self._advance()
                continue
            item = self._take(worker)
            if item.batch is None:
                self.done.add(worker)
                self.ends.append(item)
                self._advance()
                continue
            self.states[worker] = item.state
            self._advance()
            return item
        return None

    def _take(self, worker: int) -> Item:
        while not self.waiting[worker]:
            item = next(self.items)
            self.waiting[item.worker].append(item)
        return self.waiting[worker].popleft()

    def _advance(self) -> None:
        self.next_worker = (self.next_worker + 1) % self.num_workers

    def position(self) -> dict:
        return {"next": self.next_worker, "done": sorted(self.done), "workers": dict(self.states)}


class StreamBatches:
    """The training source of a stream. Batches come pass by pass from `steps`; `num_samples` is None (unknown
    until a pass ends). state_dict() gathers every rank's position (a collective: every rank calls it)."""

    num_samples = None

    def __init__(self, source, runtime: Runtime, config: DataConfig, finish: Finish, log: Callable[[str], None],
                 collate_fn: Callable = collate):
        self.sharded, self.collate = is_sharded(source), StreamCollate(collate_fn)
        self.source, self.runtime, self.config, self.finish, self.log = source, runtime, config, finish, log
        self.kind: str | None = None  # the structure of the first micro-batch: a later change is refused
        self.position: dict = {}  # this rank's position after the last step handed out
        self.resume: dict | None = None  # a checkpoint's position, for the pass it was taken in
        self.origin: tuple[str, int] | None = None  # plain streams: the pass's first sample's fingerprint, its worker
        self.epoch, self.step_in_epoch = 0, 0
        self.said = False  # how the ranks read the stream: said once, when the batch plan gives their number

    # ------------------------------------------------------------ the dry batch: the stream's first samples

    def batches(self, index_lists: list[torch.Tensor], epoch: int | None = None) -> Iterator[Batch]:
        count = max((len(idx) for idx in index_lists), default=0)
        batch = self.collate(head(self.source, count))
        if isinstance(batch, Failed):
            raise UserError(f"train data: {batch.message.removeprefix('data: ')}")
        inputs, targets = (samples.to_device(part, self.runtime.device) for part in batch)
        yield self.finish(inputs, targets, torch.arange(count, device=self.runtime.device), None)

    # ------------------------------------------------------------ one pass

    def steps(self, plan: BatchPlan, epoch: int, start_step: int) -> Iterator[list[Batch]]:
        """This rank's micro-batches for each step of pass `epoch` from `start_step`, until the stream ends on any
        rank (sharded: one small all-reduce per step says whether every rank has a whole step)."""
        layout = Layout(self.sharded, plan.rank, plan.world_size, plan.global_batch_size, plan.grad_accum_steps,
                        max(1, self.config.num_workers))
        if not self.said:
            self.log(f"train stream: {describe(self.source, plan.world_size)}")
            self.said = True
        start = self._start(layout, epoch, start_step)
        source = rank_part(self.source, layout.rank, layout.world_size) if self.sharded else self.source
        if hasattr(source, "set_epoch"):
            source.set_epoch(epoch)  # a shuffled Hugging Face stream: the same order on every rank, a new one per pass
        reader = WorkerStream(source, layout, self.collate, start.get("reader"))
        order = WorkerOrder(iter(self._loader(reader)), layout.num_workers, start)
        self.epoch, self.step_in_epoch, self.origin = epoch, start_step, None
        while True:
            items = [order.next() for _ in range(layout.grad_accum_steps)]
            vote, message = self._vote(items)
            if vote == FAILED:
                raise UserError(message)
            if vote == DRY:
                self._pass_ended(order, items, layout)
                if self.step_in_epoch == 0:  # every rank alike: the vote was agreed
                    raise UserError(f"train data: pass {epoch} of the stream gave no whole step of "
                                    f"{layout.global_batch_size} samples ({layout.world_size} ranks); fix: give more "
                                    "data or more shards, or lower train.global_batch_size")
                return
            self.step_in_epoch += 1
            self.position = self._position(order, layout)
            yield [self._finished(item, epoch) for item in items]

    def _start(self, layout: Layout, epoch: int, start_step: int) -> dict:
        """Where the pass starts: its beginning, or a checkpoint's position (exact: same world size and workers)."""
        saved, self.resume = self.resume, None
        if start_step == 0:
            return {}
        if not self.sharded:  # whole global batches from the stream's start: exact at any world size
            first = start_step * layout.grad_accum_steps  # the first micro-batch, and so the worker that reads it
            return {"reader": {"samples": start_step * layout.global_batch_size}, "next": first % layout.num_workers}
        mine = (saved or {}).get("ranks", [{}] * layout.world_size)[layout.rank]
        if not saved or saved.get("epoch") != epoch or saved.get("step_in_epoch") != start_step:
            raise UserError(f"checkpoint: holds no stream position for pass {epoch} step {start_step}; a sharded "
                            "stream resumes only from a checkpoint taken on it; fix: start afresh with a new run.dir")
        return {**mine, "reader": {int(w): s for w, s in mine["workers"].items()}}

    def _loader(self, dataset: WorkerStream):
        workers = self.config.num_workers
        if not workers:
            return iter(dataset)
        # A fresh loader per pass: its workers start from this pass's position.
        return DataLoader(dataset, batch_size=None, collate_fn=identity, num_workers=workers,
                          prefetch_factor=self.config.prefetch_factor, worker_init_fn=init_worker)

    def _vote(self, items: list[Item | None]) -> tuple[int, str]:
        failed = next((item.batch for item in items if item is not None and isinstance(item.batch, Failed)), None)
        message = f"train data: {self._at_step(failed.message.removeprefix('data: '))}" if failed \
            else self._unlike(items)
        if not message and all(items):
            message = self._changed(items)
        vote = FAILED if message else OK if all(items) else DRY
        if not self.sharded or self.runtime.world_size == 1:
            return vote, message  # plain: every rank reads the same stream, so every rank votes alike
        agreed = torch.tensor([vote], device=self.runtime.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # a rank that ran dry or failed stops every rank here
        vote = int(agreed.item())
        if vote == FAILED:
            said = [None] * self.runtime.world_size
            dist.all_gather_object(said, message)
            message = next(m for m in said if m)
        return vote, message

    def _at_step(self, message: str) -> str:
        """A bad sample's line, with where the pass met it."""
        at = f" (at step {self.step_in_epoch + 1} of pass {self.epoch}: the checkpoints before it are kept)"
        head, fix, rest = message.partition("; fix:")
        return f"{head}{at}{fix}{rest}"

    def _changed(self, items: list[Item]) -> str:
        for item in items:
            kind = kinds_of(item.batch)
            self.kind = self.kind or kind
            if kind != self.kind:
                return (f"train data: the stream's samples changed structure at step {self.step_in_epoch + 1} of "
                        f"pass {self.epoch} (from {self.kind} to {kind}); fix: make every sample of the stream "
                        "alike (the checkpoints before it are kept)")
        return ""

    def _unlike(self, items: list[Item | None]) -> str:
        """Plain streams: every DataLoader worker iterates the stream whole, so each must begin with the same sample.
        One that does not (a stream that splits itself among workers with get_worker_info, or draws random samples
        in each) would have samples lost, or batches that depend on the worker count, silently: one line instead."""
        for item in items:
            if self.sharded or item is None or not item.origin:
                continue
            self.origin = self.origin or (item.origin, item.worker)
            if item.origin != self.origin[0]:
                return (f"train data: the plain stream began with another sample in DataLoader worker {item.worker} "
                        f"than in worker {self.origin[1]} (each of the {self.config.num_workers} workers iterates it "
                        "whole and keeps its own micro-batches): it splits itself among workers (get_worker_info), "
                        "so samples would be lost, or it is another stream in each worker (random samples), so the "
                        "batches would depend on the worker count; fix: give it n_shards and shard(num_shards, index) "
                        "(a sharded source; or use distrib.data.Shards), or --set data.num_workers=1")
        return ""

    def _finished(self, item: Item, epoch: int) -> Batch:
        inputs, targets = (samples.to_device(part, self.runtime.device, non_blocking=True) for part in item.batch)
        idx = torch.arange(item.first, item.first + item.count, device=self.runtime.device)
        return self.finish(inputs, targets, idx, epoch)

    def _position(self, order: WorkerOrder, layout: Layout) -> dict:
        if not self.sharded:
            return {"samples": self.step_in_epoch * layout.global_batch_size}
        return order.position()

    def _pass_ended(self, order: WorkerOrder, items: list[Item | None], layout: Layout) -> None:
        """Every rank at the same step: count what this rank leaves (read to its end), and say it in one line."""
        left = sum(item.count for item in items if item is not None)
        while (item := order.next()) is not None:
            left += item.count
        left += sum(end.count for end in order.ends)
        trained = self.step_in_epoch
        if not self.sharded:
            read = max((end.read for end in order.ends), default=0)
            partial = read - trained * layout.global_batch_size
            self.log(f"stream pass {self.epoch} ended after {read} samples: {trained} steps of "
                     f"{layout.global_batch_size} trained, "
                     + (f"the last {partial} (a partial global batch) not" if partial else "none left over"))
            return
        lefts = [left]
        if layout.world_size > 1:
            lefts = [None] * layout.world_size
            dist.all_gather_object(lefts, left)
        self.log(f"stream pass {self.epoch} ended at step {trained} of the pass, when a rank's shards ran dry: "
                 f"samples left untrained per rank {lefts}")

    # ------------------------------------------------------------ the checkpoint's part

    def state_dict(self) -> dict:
        """Every rank's position after the last step handed out (a collective)."""
        ranks = [self.position]
        if self.runtime.world_size > 1:
            ranks = [None] * self.runtime.world_size
            dist.all_gather_object(ranks, self.position)
        return {"kind": "sharded stream" if self.sharded else "stream", "epoch": self.epoch,
                "step_in_epoch": self.step_in_epoch, "world_size": self.runtime.world_size,
                "num_workers": self.config.num_workers, "ranks": ranks}

    def load_state_dict(self, state: dict | None) -> None:
        kind = (state or {}).get("kind", "indexed")
        mine = "sharded stream" if self.sharded else "stream"
        if kind != mine:
            raise UserError(f"checkpoint: its data position is of a {kind} source, this run reads a {mine}; resume "
                            "with the data it was taken with, or start afresh with a new run.dir")
        if self.sharded and (state["world_size"], state["num_workers"]) != (self.runtime.world_size,
                                                                            self.config.num_workers):
            raise UserError(f"checkpoint: a sharded stream read by {state['world_size']} ranks x "
                            f"{state['num_workers']} DataLoader workers; this run has {self.runtime.world_size} x "
                            f"{self.config.num_workers}, which would read other shards (each rank and worker reads "
                            f"its own); resume with --nproc-per-node {state['world_size']} and data.num_workers="
                            f"{state['num_workers']}, or read the data as a plain stream")
        self.resume = state
