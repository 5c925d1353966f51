"""`distrib plan --dry-run`: one rank's real layout, built by the run's own parallelize over torch's fake process group
at the asked world size, then one training step on fake tensors under torch's memory tracker: that rank's peak, by part.

Nothing is allocated: the model is laid out on the meta device, its shards materialised as FakeTensors (shapes, no
storage), and the step (the trainer's loss, precision, activation checkpointing, micro-steps, optimizer) runs under
FakeTensorMode with FSDPMemTracker (ddp: MemTracker), which sums the bytes each tensor would hold. The optimizer's
state is created first (as a first step would), so the step measured is a steady one. On the CPU mesh whatever
dist.device says: a CUDA run also holds the blocks it prefetches (distrib.plan's BLOCKS_IN_FLIGHT), the analytic plan
counts them. Under pipeline parallel the ranks of the first and the last stage are measured, each stage run directly
on fake microbatches of the shapes a meta pass of the whole model gives (not torch's schedule: the fake group cannot
carry shapes), as many in flight as the schedule holds, packed documents' positions handed from the step as the
pipeline runner hands them (one_tensor); the larger peak is reported. A rank that holds more than
three alike blocks is measured on the model cut to 2 and 3 blocks a stage and counted for the rest (distrib.plan.blocks;
every_block: stepped whole). For a CUDA target attention runs the fused kernel's footprint (distrib.plan.attention),
not the CPU's math kernel; the verdict and the fixes are the plan's, of the measured peak."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from distrib.config import Config
from distrib.data import load_data
from distrib.data.batching import BatchPlan
from distrib.data.split import split_validation
from distrib.distributed import pipeline
from distrib.distributed.parallel import local_tensor
from distrib.distributed.parallelize import prepare
from distrib.distributed.pipeline.decoder import stage_class
from distrib.distributed.pipeline.runner import one_tensor
from distrib.distributed.runtime import Runtime
from distrib.distributed.step_inputs import microbatch
from distrib.distributed.strategies import Strategy, make_strategy
from distrib.distributed.strategies.base import StepLoss
from distrib.distributed.strategies.materialise import build_on_meta
from distrib.models.build import build_model
from distrib.plan import Machine, _size, fake_process_group, mesh_machine, meta_model
from distrib.plan import blocks as cut_blocks
from distrib.plan.attention import fused_target, target_attention
from distrib.plan.batch import first_samples, shaped_batch, staged_inputs
from distrib.plan.experts import MetaRouting, autocast_on_meta
from distrib.plan.pipeline import in_flight
from distrib.training.evaluation import autocast
from distrib.training.losses import build_loss, forward, step_loss
from distrib.training.trainer import build_optimizer

HOST = torch.device("cpu")
# The trackers' categories (FSDPMemTracker's and MemTracker's names) -> the parts the dry run reports.
PARTS = {"Sharded Param": "parameters", "Parameter": "parameters", "Buffer": "parameters",
         "Unsharded Param": "unsharded_parameters", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
         "Gradient": "gradients", "OptState": "optimizer", "Optstate": "optimizer", "Activation": "activations",
         "Inputs": "activations", "All Gather": "all_gather", "Reduce Scatter": "reduce_scatter",
         "Temp": "temporaries", "Other": "temporaries"}
PART_NAMES = ("parameters", "unsharded_parameters", "gradients", "optimizer", "activations", "all_gather",
              "reduce_scatter", "temporaries", "ddp_buckets")


class FrozenParameterHooks(TorchFunctionMode):
    """MemTracker (the dry run's tracker under ddp) registers gradient hooks on each parameter of a module at its
    forward, which a frozen one (a LoRA model's base weights) refuses: "cannot register a hook on a tensor that doesn't
    require gradient". Those are left out (a handle that removes nothing): no gradient of theirs ever comes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook) \
                and isinstance(args[0], nn.Parameter) and not args[0].requires_grad:
            return RemovableHandle(OrderedDict())
        return func(*args, **(kwargs or {}))


def dry_run(config: Config, machine: Machine, every_block: bool = False, plan: dict | None = None) -> dict:
    """The dry run's figures (plan's JSON keys dry_run_*): the measured rank's peak and its parts, and each measured
    rank's (under pp the first and the last stage's; with the blocks it holds and those stepped, where counted); given
    the plan's figures, its verdict and fixes (_verdict). A layout that cannot be built raises train's one-line
    error."""
    full = machine
    started = time.perf_counter()
    machine = mesh_machine(config, machine)  # the ranks one mesh spans (a replica group's)
    dims = make_strategy(config.dist, machine.world_size, machine.nproc_per_node).dims
    one = Runtime(0, 0, 1, 1, HOST, "gloo")
    data = split_validation(load_data(config.data, one, config.train.seed, log=lambda message: None), config.data)
    batches = BatchPlan(data.train.num_samples, config.train.global_batch_size, config.train.grad_accum_steps, 0,
                        dims.batch_ranks, config.train.seed)
    ranks = sorted({dims.rank_at(pp=0), dims.rank_at(pp=dims.pipeline - 1)})  # every other coordinate 0: the fullest
    sample = first_samples(data.train, batches.micro_batch_size)  # the data's structure, dtypes and shapes
    # one group for all ranks (torch's meshes outlive a destroyed group); MetaRouting: an MoE layer's fake step;
    # autocast_on_meta: peft's LoRA on its experts in stage_inputs' meta pass; FrozenParameterHooks: frozen weights
    held = _held_blocks(config, data.info, dims, ranks, every_block)
    with fake_process_group(machine.world_size), MetaRouting(), autocast_on_meta(), FrozenParameterHooks(), \
            target_attention(config.dist.device):
        measured = [measure_rank(config, machine, data.info, batches, rank, sample) if not held else
                    cut_blocks.extended(*(measure_rank(config, machine, data.info, batches, rank, sample,
                                                       k * cut_blocks.stages(config)) for k in cut_blocks.MEASURED),
                                        held["measured"], held[rank])
                    for rank in ranks]
    top = max(measured, key=lambda figures: figures["peak_bytes"])
    verdict = _verdict(config, full, data.info, top["parts"], top["peak_bytes"], plan) if plan else {}
    return {**verdict, "dry_run_peak_bytes_per_rank": top["peak_bytes"], "dry_run_rank": top["rank"],
            **{f"dry_run_{part}_bytes": top["parts"][part] for part in PART_NAMES},
            "dry_run_ranks": measured, "dry_run_world_size": machine.world_size,
            "dry_run_attention": "fused" if fused_target(config.dist.device) else "math",
            "dry_run_seconds": time.perf_counter() - started}


def _verdict(config: Config, machine: Machine, info, parts: dict, peak: int, plan: dict) -> dict:
    """The plan's verdict of the measured peak: it, the block FSDP prefetches on an accelerator (the dry run's CPU
    mesh turns prefetching off: distrib.distributed.fsdp.shard) and the allocator's slack as the plan counts it
    (distrib.plan.host), against the device's memory; where it does not fit, the plan's fixes (distrib.plan.fixes),
    each moving the peak by what it moves in the plan's terms of the measured parts."""
    from distrib.plan import _fixes, allocator_slack, gathered_bytes
    from distrib.plan.fixes import Step

    strategy = make_strategy(config.dist, *_mesh_ranks(config, machine))
    device, tp = torch.device("cuda" if fused_target(config.dist.device) else "cpu"), strategy.dims.tensor_parallel
    model = meta_model(config, info)
    prefetched = gathered_bytes(config, model, device, tp) - gathered_bytes(config, model, HOST, tp) \
        if strategy.sharded_state and strategy.dims.pipeline == 1 else 0
    in_flight = parts["unsharded_parameters"] + parts["all_gather"] + parts["reduce_scatter"] + prefetched
    slack = allocator_slack(model, device, strategy.sharded_state, parts["activations"] + in_flight, tp)
    needed = peak + prefetched + slack
    fits = needed <= machine.device_memory
    step = Step(parts["parameters"], parts["gradients"], parts["optimizer"], parts["activations"], in_flight,
                parts["temporaries"], parts["ddp_buckets"], slack, config.train.grad_accum_steps)
    found = [] if fits else _fixes(config, strategy, machine, model,
                                   [(step, plan["activation_bytes_per_micro_batch_checkpointed"])],
                                   pipeline.microbatches(config.dist), device)
    moved = [{**fix, "memory_bytes_per_rank": fix["memory_bytes_per_rank"] + needed - step.peak} for fix in found]
    return {"dry_run_memory_bytes_per_rank": needed, "dry_run_prefetched_bytes": prefetched,
            "dry_run_allocator_slack_bytes": slack, "dry_run_fits": fits, "dry_run_fixes": [
                {**fix, "fits": fix["memory_bytes_per_rank"] <= machine.device_memory} for fix in moved
                if fix["memory_bytes_per_rank"] < needed]}


def _mesh_ranks(config: Config, machine: Machine) -> tuple[int, int]:
    mesh = mesh_machine(config, machine)
    return mesh.world_size, mesh.nproc_per_node


def _held_blocks(config: Config, info, dims, ranks: list[int], every_block: bool) -> dict:
    """{rank: the blocks it holds, "measured": the blocks it is stepped with cut}, where the dry run counts blocks
    (distrib.plan.blocks): they are alike, the pipeline's split is the balanced one, and a rank holds more than it
    would be stepped with; else {} (stepped whole)."""
    if every_block or config.dist.pipeline_split:
        return {}
    model = meta_model(config, info)
    found = cut_blocks.block_list(model, config)
    per_rank = config.dist.stages_per_rank if config.dist.pipeline_parallel > 1 else 1
    measured = tuple(k * per_rank for k in cut_blocks.MEASURED)
    held = {rank: cut_blocks.held_blocks(config, len(found or ()), dims.pipeline_rank(rank)) for rank in ranks}
    return {**held, "measured": measured} if found is not None and min(held.values()) > measured[1] else {}


def measure_rank(config: Config, machine: Machine, info, batches: BatchPlan, rank: int, sample,
                 blocks: int | None = None) -> dict:
    """`rank`'s layout, its optimizer's state created, and one step on micro-batches shaped as `sample` (the data's
    first samples, distrib.plan.batch) measured: its peak and parts; of the model cut to its first `blocks` blocks
    where given (distrib.plan.blocks). Over the fake
    group's rank 0, as plan's (distrib.plan.planned_rank): the measured ranks differ from it in their pipeline rank
    only, which lay_out reads from runtime.rank."""
    from distrib.torch_private import FakeTensorMode

    strategy = make_strategy(config.dist, machine.world_size, machine.nproc_per_node)  # its own mesh, this group's
    runtime = Runtime(rank, rank % machine.nproc_per_node, machine.world_size, machine.nproc_per_node, HOST, "fake")
    # each stage's input shapes, given: from a meta pass outside the fake mode (which refuses the meta model's casts)
    given = stage_inputs(config, info, batches.micro_batch_size // pipeline.microbatches(config.dist), sample,
                         blocks) if strategy.dims.pipeline > 1 else []
    fake = FakeTensorMode(allow_non_fake_inputs=True)  # the meta model's tensors go in, fake ones come out
    model = laid_out(config, strategy, info, runtime, fake, blocks)
    with fake:
        optimizer = build_optimizer(model, config.train)
        _create_state(model, optimizer)
        tracker = _tracker(strategy, model, optimizer)
        phases = []  # the peak so far at each turn of the first micro-step (a pipeline's: _pipeline_step)
        with tracker:
            if strategy.dims.pipeline > 1:
                _pipeline_step(config, strategy, model, sample, batches, rank, given, tracker.reset_mod_stats,
                               lambda: phases.append(tracker.get_tracker_snapshot("peak").get(HOST, {})))
            else:
                _step(config, strategy, model, sample, batches)
            _optimizer_step(config, strategy, model, optimizer)
    peak = tracker.get_tracker_snapshot("peak").get(HOST, {})
    state = sum(local_tensor(t).nbytes for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    buckets = _ddp_buckets(config, strategy, model)
    parts = {**_parts(peak, state), "ddp_buckets": buckets}
    return {"rank": rank, "pipeline_rank": strategy.dims.pipeline_rank(rank),
            "peak_bytes": peak.get("Total", 0) + buckets, "parts": parts,
            "phase_parts": [{**_parts(phase, state), "ddp_buckets": buckets} for phase in phases]}


def _ddp_buckets(config: Config, strategy: Strategy, model: nn.Module) -> int:
    """DDP's gradient buckets, which its reducer allocates at wrapping and keeps (a copy of the gradients, unless
    speed.gradient_as_bucket_view makes the gradients views of them): counted, not measured."""
    if strategy.dims.fully_shard or config.speed.gradient_as_bucket_view:
        return 0
    return sum(p.nbytes for p in model.parameters() if p.requires_grad)


def laid_out(config: Config, strategy: Strategy, info, runtime: Runtime, fake, blocks: int | None = None
             ) -> nn.Module:
    """The model as runtime.rank holds it, by the run's own calls (as strategy.setup_module lays it out, compile
    left out: it changes no tensor's size), its tensors fake (made under `fake`): sharded on meta then materialised,
    or materialised whole (ddp). The mesh is built outside the fake mode (it reads real tensors): plan_module's. Cut
    to its first `blocks` blocks where given."""
    speed = dataclasses.replace(config.speed, compile=False)
    model = build_on_meta(lambda: _cut(build_model(config.model, info), config, blocks), config.train.seed)
    if strategy.dims.fully_shard:
        model = strategy.plan_module(model, runtime, config.train.precision, speed)
    else:  # parallelize's steps before DDP's wrapper (ddp takes no tensor parallel), which cannot wrap fake tensors:
        prepare(model, speed, config.dist.shard_modules)  # its buckets are counted (_ddp_buckets)
    with fake:
        return model.to_empty(device=HOST)


def _cut(model: nn.Module, config: Config, blocks: int | None) -> nn.Module:
    return model if blocks is None else cut_blocks.cut(model, config, blocks)


def _create_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state (momenta, moments), as a first step leaves it; no gradients left. Stepped as the trainer
    steps (foreach, in chunks): a state created tensor by tensor made the measured step's temporaries 2x as large."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param) if param.requires_grad else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tracker(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer):
    """FSDPMemTracker over a sharded model (the runner's roots: its stages' under pp), MemTracker over DDP's."""
    from torch.distributed.fsdp import FSDPModule

    from distrib.torch_private import FSDPMemTracker, MemTracker

    roots = strategy.runner.roots(model)
    if not isinstance(roots[0], FSDPModule):
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        return tracker
    tracker = FSDPMemTracker(roots[0], optimizer)
    # It instruments the FSDP modules its root's modules() walks: every stage's root (views, outside the module that
    # holds them) and their units, the way a list of them walks.
    tracker._root_mod = nn.ModuleList(roots)
    return tracker


def _step_loss(config: Config, strategy: Strategy, targets: list) -> StepLoss:
    """The trainer's StepLoss (distrib.training.trainer): the config's loss, normalised once for the step."""
    shares = strategy.runner.loss_shares(strategy.dims.world_size)
    return StepLoss(loss=step_loss(build_loss(config.train), targets, shares), forward=forward,
                    autocast=lambda: autocast(config.train.precision, HOST), backward=lambda loss: loss.backward(),
                    batch=lambda inputs, targets: {}, device=HOST)


def _step(config: Config, strategy: Strategy, model: nn.Module, sample, batches: BatchPlan) -> None:
    """The trainer's forward and backward of a step's micro-batches (strategy.forward_backward), of fake tensors
    (made on the host under the fake mode) shaped as the data's."""
    micro_batches = [shaped_batch(sample, batches.micro_batch_size, HOST) for _ in range(batches.grad_accum_steps)]
    strategy.forward_backward(model, micro_batches, _step_loss(config, strategy, [t for _, t in micro_batches]))


def stage_inputs(config: Config, info, size: int, sample, blocks: int | None = None) -> list[torch.Tensor]:
    """Each stage's input for a microbatch of `size` samples, as meta tensors: the whole model on meta (cut to
    `blocks` where given), forwarded stage by stage (the shapes each stage is given)."""
    dist_config = config.dist
    model = _cut(meta_model(config, info), config, blocks)
    split = pipeline.split_stages(model, dist_config.pipeline_parallel * dist_config.stages_per_rank,
                                  dist_config.pipeline_split, dist_config.pipeline_parallel)
    cls = stage_class(model)  # as lay_out views the stages (a Hugging Face decoder's run their units themselves)
    staged_inputs(sample, dist_config.pipeline_parallel)
    inputs = []
    with torch.no_grad(), one_tensor(shaped_batch(sample, size)[0]) as x:  # packed documents: positions from the step
        for stage in range(split.num_stages):
            inputs.append(x)
            x = pipeline.view(model, split.units, set(split.stage_units(stage)), cls)(x)
    return inputs


def _pipeline_step(config: Config, strategy: Strategy, model: nn.Module, sample, batches: BatchPlan, rank: int,
                   inputs: list[torch.Tensor], next_microbatch, turned) -> None:
    """Each micro-step, this rank's stages on their microbatches as torch's schedule holds them: as many forwarded
    before the first backward as the schedule keeps in flight (distrib.plan.pipeline.in_flight), then the others one
    by one; each stage reduces its gradients in its last backward only (the schedule's no-sync backwards). turned()
    is called at the first micro-step's turns: before its first backward and after each (distrib.plan.blocks)."""
    dist_config, stages = config.dist, strategy.runner.stages
    count = pipeline.microbatches(dist_config)
    mine = pipeline.stages_of(strategy.dims.pipeline_rank(rank), dist_config.pipeline_parallel,
                              dist_config.stages_per_rank, dist_config.pipeline_schedule)
    held = in_flight(dist_config.pipeline_schedule, dist_config.pipeline_parallel, dist_config.stages_per_rank, count,
                     strategy.dims.pipeline_rank(rank))
    batch, targets = shaped_batch(sample, batches.micro_batch_size, HOST)
    step = _step_loss(config, strategy, [targets] * batches.grad_accum_steps)
    last, forwarded = len(inputs) - 1, dict.fromkeys(mine, 0)

    def forward_one(stage: int) -> torch.Tensor:
        next_microbatch()  # the tracker's per-module figures (not its peak) start again: it takes one pass per module
        received = torch.zeros_like(inputs[stage], device=HOST)
        received.requires_grad_(stage > 0 and received.is_floating_point())
        with step.autocast(), microbatch(forwarded[stage]):  # as the runner's stages: the step's rows of it
            forwarded[stage] += 1
            out = stages[stage](received)
            return step.loss(out, targets[:len(received)], count) if stage == last else out

    def backward_one(stage: int, out: torch.Tensor, done: int) -> None:
        final = done == count - 1
        stages[stage].set_is_last_backward(final)
        stages[stage].set_reshard_after_backward(final)
        stages[stage].set_requires_gradient_sync(final)
        out.backward() if stage == last else out.backward(torch.ones_like(out))

    for micro_step in range(batches.grad_accum_steps):
        forwarded.update(dict.fromkeys(mine, 0))
        with one_tensor(batch, count):  # the runner's: packed documents' positions reach every stage from the step
            _micro_step(mine, held, count, forward_one, backward_one, turned if micro_step == 0 else None)


def _micro_step(mine: list[int], held: list[int], count: int, forward_one, backward_one, turned) -> None:
    """One micro-step of this rank's stages `mine`: `held` microbatches of each forwarded before the first backward,
    then the others one by one; turned() (None: nothing) at the turns, before the first backward and after each."""
    first = turned or (lambda: None)
    pending = [(stage, forward_one(stage)) for stage, kept in zip(mine, held) for _ in range(kept)]
    first()
    done = dict.fromkeys(mine, 0)
    for stage, out in pending:
        backward_one(stage, out, done[stage])
        done[stage] += 1
        first()
    for stage, kept in zip(mine, held):
        for _ in range(count - kept):
            backward_one(stage, forward_one(stage), done[stage])
            done[stage] += 1
            first()


def _optimizer_step(config: Config, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if config.train.grad_clip:
        strategy.clip_grad_norm(model, config.train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _parts(peak: dict, optimizer_state: int) -> dict:
    """The tracker's peak snapshot in the dry run's parts; what the optimizer allocates in its step beyond its state
    (its chunks' temporaries) among the temporaries."""
    parts = dict.fromkeys(PART_NAMES, 0)
    for kind, nbytes in peak.items():
        if kind != "Total":
            parts[PARTS.get(getattr(kind, "value", kind), "temporaries")] += nbytes
    beyond = max(0, parts["optimizer"] - optimizer_state)
    parts["optimizer"] -= beyond
    parts["temporaries"] += beyond
    return parts


PART_WORDS = {"parameters": "parameters", "unsharded_parameters": "gathered parameters", "gradients": "gradients",
              "optimizer": "optimizer state", "activations": "activations", "all_gather": "all-gather buffers",
              "reduce_scatter": "reduce-scatter buffers", "temporaries": "temporaries", "ddp_buckets": "DDP buckets"}


def rows(figures: dict) -> list[tuple[str, str]]:
    """The dry run's lines under the plan's table: the measured peak beside the plan's, its parts, each rank's, its
    verdict and fixes (as the plan's), how it was measured."""
    from distrib.plan import _fix_rows

    f = figures
    measured = ", ".join(f"rank {r['rank']} (pipeline rank {r['pipeline_rank']}) {_size(r['peak_bytes'])}"
                         for r in f["dry_run_ranks"])
    parts = ", ".join(f"{words} {_size(f[f'dry_run_{part}_bytes'])}" for part, words in PART_WORDS.items()
                      if f[f"dry_run_{part}_bytes"])
    counted, slack = f["dry_run_ranks"][0].get("measured_blocks"), f["allocator_slack_bytes_per_rank"]
    how = f"{f['dry_run_attention']} attention" + (
        f", {counted[0]} and {counted[1]} blocks stepped and the rank's {f['dry_run_ranks'][0]['blocks']} counted"
        if counted else "")
    return [("dry run peak / rank", f"{_size(f['dry_run_peak_bytes_per_rank'])} measured on fake tensors (rank "
                                    f"{f['dry_run_rank']}), plan {_size(f['memory_bytes_per_rank'] - slack)} "
                                    f"(without its allocator slack, {_size(slack)})"),
            ("dry run parts at the peak", parts),
            *([("dry run ranks", measured)] if len(f["dry_run_ranks"]) > 1 else []),
            *_verdict_rows(f, _fix_rows),
            ("dry run", f"the layout built on a fake group of {f['dry_run_world_size']} ranks and one step run in "
                        f"{f['dry_run_seconds']:.1f} s ({how})")]


def _verdict_rows(f: dict, fix_rows) -> list[tuple[str, str]]:
    if "dry_run_fits" not in f:
        return []
    row = (f"{'fits' if f['dry_run_fits'] else 'DOES NOT FIT'}: {_size(f['dry_run_memory_bytes_per_rank'])} of "
           f"{_size(f['device_memory_bytes'])} (the measured peak" + (
               f", the block prefetched {_size(f['dry_run_prefetched_bytes'])}" if f["dry_run_prefetched_bytes"]
               else "") + f", allocator slack {_size(f['dry_run_allocator_slack_bytes'])})")
    fixes = fix_rows({"fits": f["dry_run_fits"], "fixes": f["dry_run_fixes"]})
    return [("dry run device memory", row), *((f"dry run {name}" if name else "", text) for name, text in fixes)]


def main(config: Config, machine: Machine, as_json: bool, every_block: bool = False) -> int:
    """`distrib plan --dry-run`: the plan's figures and the dry run's beside them, with its verdict."""
    from distrib.plan import plan_run, table

    planned = plan_run(config, machine)
    figures = {**planned, **dry_run(config, machine, every_block, planned)}
    if as_json:
        print(json.dumps(figures, indent=1))
    else:
        print(table(figures, machine) + "\n" + "\n".join(f"{name:<26} {value}" for name, value in rows(figures)))
    return 0
