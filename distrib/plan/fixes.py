"""A step's peak per rank, term by term, and what makes a plan that does not fit the device fit: activation
checkpointing, more gradient accumulation, more shards, the state on the host; each fix with the peak those terms give.

The fixes change only what they change in the plan's own terms (a micro-batch k times smaller keeps k times fewer
activations; n times more shards hold n times less state), so each is as exact as the plan it starts from, and one
that `distrib plan` with it confirms."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass(frozen=True, slots=True)
class Step:
    """What a rank holds at a step's peak (memory_bytes_per_rank): the parameters and the optimizer state throughout,
    DDP's gradient buckets and the allocator's slack; in the backward, the blocks gathered in flight and the larger of
    the activations not yet freed and the gradients already reduced (both, where earlier micro-steps left gradients);
    at the optimizer's step, the gradients and its temporaries."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    gathered: int
    temporaries: int
    buckets: int
    slack: int
    grad_accum_steps: int
    buffers: int = 0  # a pipeline rank's receive buffers (distrib.plan.pipeline)
    unsharded: int | None = None  # a pipeline rank's gradients unsharded until the step's end (None: no pipeline)
    drained: int = 0  # of the activations, what a pipeline rank's first backward frees before any forward refills it

    @property
    def peak(self) -> int:
        grads, activations = self.gradients, self.activations
        if self.unsharded is not None:  # a pipeline rank: its stages reduce their gradients after all backwards
            # the first backward's start (all in flight, no gradient yet) or its end (the gradients whole, less the
            # microbatch it freed where no forward follows: distrib.plan.pipeline.drained_bytes)
            held = max(activations, activations - self.drained + self.unsharded)
            backward = self.gathered + held + self.buffers + (grads if self.grad_accum_steps > 1 else 0)
            return self.parameters + self.optimizer + self.slack + max(
                backward, self.unsharded + grads + self.buffers, grads + self.temporaries + self.buffers)
        held = activations + grads if self.grad_accum_steps > 1 else max(activations, grads)
        return self.parameters + self.optimizer + self.buckets + self.slack + max(
            self.gathered + held, grads + self.temporaries)

    def smaller(self, times: float) -> Step:
        """Its micro-batch `times` smaller: as many times fewer activations and pipeline receive buffers."""
        return dataclasses.replace(self, activations=round(self.activations / times),
                                   buffers=round(self.buffers / times), drained=round(self.drained / times))

    def sharded(self, times: float) -> Step:
        """Its state (and the optimizer's chunk of it) on `times` as many shards."""
        return dataclasses.replace(self, parameters=round(self.parameters / times),
                                   gradients=round(self.gradients / times), optimizer=round(self.optimizer / times),
                                   temporaries=round(self.temporaries / times))


@dataclass(frozen=True, slots=True)
class Run:
    """What the fixes need to know of the planned run beside its step."""

    step: Step
    checkpointed: int  # activations per micro-batch with speed.activation_checkpointing = blocks
    checkpointing: bool  # already on
    sharded: bool  # the state in shards (fsdp, hsdp); else whole on every rank (ddp)
    global_batch_size: int
    data_parallel: int
    shard_group: int  # the ranks each state is sharded over: 1 under ddp, dist.shard_size under hsdp
    nnodes: int
    on_accelerator: bool
    offloaded: bool
    sharded_gathered: int  # what fsdp would gather in flight (a ddp run's fix)
    slack: Callable[[int, int, bool], int]  # (activations, gathered, sharded) -> the allocator's slack
    microbatches: int = 1  # a pipeline's per micro-batch: each micro-step's samples split into as many
    drained_checkpointed: int = 0  # a pipeline rank's Step.drained with speed.activation_checkpointing = blocks


def fixes(runs: Run | list[Run], device_memory: float) -> list[dict]:
    """Each fix that lowers the peak and is not on already, as {"fix": what to pass, "memory_bytes_per_rank": its
    peak, "fits": bool}. Under pipeline parallel `runs` has each pipeline rank's: a fix's peak is the highest it
    gives any of them (they try the same fixes, in the same order)."""
    runs = [runs] if isinstance(runs, Run) else runs
    found = [[(kind, [(fix, step.peak) for fix, step in tries])
              for kind, tries in [*_checkpointing(run), *_accumulation(run), *_shards(run), *_offload(run)]]
             for run in runs]
    highest = [(kinds[0][0], [(same[0][0], max(peak for _, peak in same)) for same in zip(*(t for _, t in kinds))])
               for kinds in zip(*found)]  # per kind, per fix (the same on every rank): the highest rank's peak
    peak = max(run.step.peak for run in runs)
    return [{"fix": fix, "memory_bytes_per_rank": fixed, "fits": fixed <= device_memory}
            for fix, fixed in _first_fitting(highest, device_memory) if fixed < peak]


def _first_fitting(found: list[tuple[str, list[tuple[str, int]]]], device_memory: float
                   ) -> Iterator[tuple[str, int]]:
    """Of each kind of fix, tried from the least change to the most: the first that fits, else the last tried."""
    for _, tries in found:
        if tries:
            yield next(((fix, peak) for fix, peak in tries if peak <= device_memory), tries[-1])


def _with(run: Run, step: Step, activations: int, sharded: bool) -> Step:
    return dataclasses.replace(step, activations=activations, slack=run.slack(activations, step.gathered, sharded))


def _checkpointing(run: Run):
    if run.checkpointing:
        return
    step = _with(run, dataclasses.replace(run.step, drained=run.drained_checkpointed), run.checkpointed, run.sharded)
    yield "checkpointing", [("--set speed.activation_checkpointing=blocks", step)]


def _accumulation(run: Run):
    """train.grad_accum_steps k times the run's: a micro-batch k times smaller, down to one sample."""
    step, per_rank = run.step, run.global_batch_size // run.data_parallel
    tries = []
    for accum in range(step.grad_accum_steps + 1, per_rank + 1):
        if per_rank % (accum * run.microbatches) == 0:
            less = step.smaller(accum / step.grad_accum_steps)
            smaller = dataclasses.replace(_with(run, less, less.activations, run.sharded), grad_accum_steps=accum)
            tries.append((f"--set train.grad_accum_steps={accum} (micro-batch {per_rank // accum})", smaller))
    yield "accumulation", tries


def _shards(run: Run):
    """ddp: fsdp over its data-parallel ranks; hsdp: fsdp, one shard group of all of them; fsdp: more nodes (the
    same global batch, so each rank's micro-batch shrinks too)."""
    step = run.step
    if not run.sharded:
        sharded = dataclasses.replace(step.sharded(run.data_parallel), buckets=0, gathered=run.sharded_gathered)
        yield "shards", [("--set dist.strategy=fsdp", _with(run, sharded, step.activations, True))]
    elif run.shard_group < run.data_parallel:  # hsdp
        times = run.data_parallel // run.shard_group
        yield "shards", [("--set dist.strategy=fsdp", _with(run, step.sharded(times), step.activations, True))]
    else:
        tries = []
        for times in (2, 4, 8, 16, 32, 64):
            ranks = run.data_parallel * times
            if run.global_batch_size % (ranks * step.grad_accum_steps * run.microbatches) == 0:
                less = step.sharded(times).smaller(times)
                more = _with(run, less, less.activations, True)
                tries.append((f"--nnodes {run.nnodes * times} ({ranks} data-parallel ranks)", more))
        yield "shards", tries


def _offload(run: Run):
    """On an accelerator: the shards of parameters, gradients and optimizer state in host memory."""
    if not run.on_accelerator or run.offloaded:
        return
    gathered = run.step.gathered if run.sharded else run.sharded_gathered
    on_device = dataclasses.replace(run.step, parameters=0, gradients=0, optimizer=0, gathered=gathered,
                                    temporaries=0, buckets=0, slack=0)
    fix = "--set dist.cpu_offload=true" if run.sharded else \
        "--set dist.strategy=fsdp --set dist.cpu_offload=true"
    yield "offload", [(fix, on_device)]
