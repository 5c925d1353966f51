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

    @property
    def peak(self) -> int:
        grads, activations = self.gradients, self.activations
        held = activations + grads if self.grad_accum_steps > 1 else max(activations, grads)
        return self.parameters + self.optimizer + self.buckets + self.slack + max(
            self.gathered + held, grads + self.temporaries)

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


def fixes(run: Run, device_memory: float) -> list[dict]:
    """Each fix that lowers the peak, as {"fix": what to pass, "memory_bytes_per_rank": its peak, "fits": bool}."""
    found = [*_checkpointing(run), *_accumulation(run), *_shards(run), *_offload(run)]
    return [{"fix": fix, "memory_bytes_per_rank": step.peak, "fits": step.peak <= device_memory}
            for fix, step in _first_fitting(found, device_memory) if step.peak < run.step.peak]


def _first_fitting(found: list[tuple[str, list[tuple[str, Step]]]], device_memory: float
                   ) -> Iterator[tuple[str, Step]]:
    """Of each kind of fix, tried from the least change to the most: the first that fits, else the last tried."""
    for _, tries in found:
        if tries:
            yield next(((fix, step) for fix, step in tries if step.peak <= device_memory), tries[-1])


def _with(run: Run, step: Step, activations: int, sharded: bool) -> Step:
    return dataclasses.replace(step, activations=activations, slack=run.slack(activations, step.gathered, sharded))


def _checkpointing(run: Run):
    if run.checkpointing:
        return
    step = _with(run, run.step, run.checkpointed, run.sharded)
    yield "checkpointing", [("--set speed.activation_checkpointing=blocks", step)]


def _accumulation(run: Run):
    """train.grad_accum_steps k times the run's: a micro-batch k times smaller, down to one sample."""
    step, per_rank = run.step, run.global_batch_size // run.data_parallel
    tries = []
    for accum in range(step.grad_accum_steps + 1, per_rank + 1):
        if per_rank % accum == 0:
            activations = step.activations * step.grad_accum_steps // accum
            smaller = dataclasses.replace(_with(run, step, activations, run.sharded), grad_accum_steps=accum)
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
            if run.global_batch_size % (ranks * step.grad_accum_steps) == 0:
                more = _with(run, step.sharded(times), step.activations // times, True)
                tries.append((f"--nnodes {run.nnodes * times} ({ranks} data-parallel ranks)", more))
        yield "shards", tries


def _offload(run: Run):
    """On an accelerator: the shards of parameters, gradients and optimizer state in host memory."""
    if not run.on_accelerator or run.offloaded:
        return
    gathered = run.step.gathered if run.sharded else run.sharded_gathered
    on_device = Step(0, 0, 0, run.step.activations, gathered, 0, 0, 0, run.step.grad_accum_steps)
    fix = "--set dist.cpu_offload=true" if run.sharded else \
        "--set dist.strategy=fsdp --set dist.cpu_offload=true"
    yield "offload", [(fix, on_device)]
