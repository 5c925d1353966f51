"""`distrib plan --dry-run`: one rank's real layout, built by the run's own parallelize over torch's fake process group
at the asked world size, then one training step on fake tensors under torch's memory tracker: that rank's peak, by part.

Nothing is allocated: the model is laid out on the meta device, its shards materialised as FakeTensors (shapes, no
storage), and the step (the trainer's loss, precision, activation checkpointing, micro-steps, optimizer) runs under
FakeTensorMode with FSDPMemTracker (ddp: MemTracker), which sums the bytes each tensor would hold. The optimizer's
state is created first (as a first step would), so the step measured is a steady one. On the CPU mesh whatever
dist.device says: a CUDA run also holds the blocks it prefetches (distrib.plan.peak.BLOCKS_IN_FLIGHT), the analytic plan
counts them. Under pipeline parallel the ranks of the first and the last stage are measured, each stage run directly
on fake microbatches of the shapes a meta pass of the whole model gives (not torch's schedule: the fake group cannot
carry shapes), as many in flight as the schedule holds, packed documents' positions handed from the step as the
pipeline runner hands them (one_tensor); the larger peak is reported. A rank that holds more than
three alike blocks is measured on the model cut to 2 and 3 blocks a stage and counted for the rest (distrib.plan.blocks;
every_block: stepped whole). For a CUDA target attention runs the fused kernel's footprint (distrib.plan.attention),
not the CPU's math kernel; the verdict and the fixes are the plan's, of the measured peak."""

from __future__ import annotations

import json
import time

import torch

from distrib.config import Config
from distrib.data import load_data
from distrib.data.batching import BatchPlan
from distrib.data.split import split_validation
from distrib.distributed import pipeline
from distrib.distributed.parallel import local_tensor
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import make_strategy
from distrib.plan import blocks as cut_blocks
from distrib.plan import plan_run
from distrib.plan.attention import fused_target, target_attention
from distrib.plan.batch import first_samples
from distrib.plan.dry_run_rows import rows
from distrib.plan.experts import MetaRouting, autocast_on_meta
from distrib.plan.fake_pipeline import pipeline_step, stage_inputs
from distrib.plan.fake_step import (
    HOST,
    FrozenParameterHooks,
    create_state,
    ddp_buckets,
    laid_out,
    memory_tracker,
    optimizer_step,
    run_step,
)
from distrib.plan.fixes import Step
from distrib.plan.host import allocator_slack
from distrib.plan.machine import Machine, fake_process_group, mesh_machine
from distrib.plan.peak import gathered_bytes, plan_fixes
from distrib.plan.rank import meta_model
from distrib.plan.report import table
from distrib.training.optimizers import build_optimizer

# The trackers' categories (FSDPMemTracker's and MemTracker's names) -> the parts the dry run reports.
PARTS = {"Sharded Param": "parameters", "Parameter": "parameters", "Buffer": "parameters",
         "Unsharded Param": "unsharded_parameters", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
         "Gradient": "gradients", "OptState": "optimizer", "Optstate": "optimizer", "Activation": "activations",
         "Inputs": "activations", "All Gather": "all_gather", "Reduce Scatter": "reduce_scatter",
         "Temp": "temporaries", "Other": "temporaries"}


PART_NAMES = ("parameters", "unsharded_parameters", "gradients", "optimizer", "activations", "all_gather",
              "reduce_scatter", "temporaries", "ddp_buckets")


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
    found = [] if fits else plan_fixes(config, strategy, machine, model,
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
    group's rank 0, as plan's (distrib.plan.rank.planned_rank): the measured ranks differ from it in their pipeline rank
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
        create_state(model, optimizer)
        tracker = memory_tracker(strategy, model, optimizer)
        phases = []  # the peak so far at each turn of the first micro-step (a pipeline's: pipeline_step)
        with tracker:
            if strategy.dims.pipeline > 1:
                pipeline_step(config, strategy, model, sample, batches, rank, given, tracker.reset_mod_stats,
                              lambda: phases.append(tracker.get_tracker_snapshot("peak").get(HOST, {})))
            else:
                run_step(config, strategy, model, sample, batches)
            optimizer_step(config, strategy, model, optimizer)
    peak = tracker.get_tracker_snapshot("peak").get(HOST, {})
    state = sum(local_tensor(t).nbytes for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    buckets = ddp_buckets(config, strategy, model)
    parts = {**_parts(peak, state), "ddp_buckets": buckets}
    return {"rank": rank, "pipeline_rank": strategy.dims.pipeline_rank(rank),
            "peak_bytes": peak.get("Total", 0) + buckets, "parts": parts,
            "phase_parts": [{**_parts(phase, state), "ddp_buckets": buckets} for phase in phases]}


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


def main(config: Config, machine: Machine, as_json: bool, every_block: bool = False) -> int:
    """`distrib plan --dry-run`: the plan's figures and the dry run's beside them, with its verdict."""
    planned = plan_run(config, machine)
    figures = {**planned, **dry_run(config, machine, every_block, planned)}
    if as_json:
        print(json.dumps(figures, indent=1))
    else:
        print(table(figures, machine) + "\n" + "\n".join(f"{name:<26} {value}" for name, value in rows(figures)))
    return 0
