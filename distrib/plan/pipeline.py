"""`distrib plan` under pipeline parallel (dist.pipeline_parallel > 1): each pipeline rank's stages sharded as the run
shards them, what each rank holds in a step, the schedule's bubble, and the activations sent between stages.

What a rank holds beyond its state, as torch's schedules run FSDP2 stages (torch.distributed.pipelining, torch 2.14):
the activations of the microbatches its schedule has in flight; the receive buffers a stage allocates once for every
microbatch (activations from the stage before, the gradients of its input sent back to it, the gradients from the
stage after); and from its first backward to the step's end its stages' parameters gathered and their gradients
unsharded in fp32 (each backward but the last runs without resharding or reducing; the stage reduces after all)."""

from __future__ import annotations

import torch
import torch.nn as nn

from distrib.config import Config
from distrib.data.batching import BatchPlan
from distrib.distributed import fsdp, pipeline
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import local_tensor
from distrib.distributed.pipeline import owner_of, split_stages, stage_class, stages_of, view
from distrib.distributed.pipeline.runner import one_tensor
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import Strategy
from distrib.plan.activations import rank_batch, split_as_run, target_attention
from distrib.plan.batch import shaped_batch, staged_inputs
from distrib.plan.experts import held_experts
from distrib.plan.fixes import Step
from distrib.plan.host import KEPT_SLACK, returns_freed_memory
from distrib.plan.machine import Machine
from distrib.plan.peak import optimizer_temporaries
from distrib.plan.rank import local_parameters, meta_model, planned_rank, state_parts_planned
from distrib.plan.saved import loss_gradient_bytes, saved_parts


def bubble_share(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a step each rank idles, ramping the pipeline up and down: (P - 1) / (M + P - 1) for gpipe and
    1f1b, (P - 1) / (V M + P - 1) with V stages per rank interleaved (each rank's work comes in V M smaller pieces)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, stages_per_rank: int, microbatches: int, pipeline_rank: int) -> list[int]:
    """Microbatches whose activations a pipeline rank holds at once, for each of its stages (stages_of's order):
    gpipe all M; 1f1b P - r (the first rank P, the last 1; M at most); interleaved the forwards torch's
    ScheduleInterleaved1F1B runs before a backward frees one: (V - 1) x its microbatches per round + 2 (P - 1 - r),
    plus the steady state's forward, taken in rounds stage by stage."""
    if schedule == "gpipe":
        return [microbatches]
    if schedule == "1f1b":
        return [min(microbatches, pp - pipeline_rank)]
    per_round = microbatches // max(1, microbatches // pp)
    total = stages_per_rank * microbatches
    warmup = min((stages_per_rank - 1) * per_round + 2 * (pp - 1 - pipeline_rank), total)
    counts = [0] * stages_per_rank
    for forward in range(min(warmup + 1, total)):
        counts[forward // per_round % stages_per_rank] += 1
    return counts


def stage_passes(model: nn.Module, split, blocks: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor
                 ) -> list[dict]:
    """One microbatch through each stage in turn, on the whole meta model in the compute dtype: the bytes a stage
    keeps for its backward (autograd's saved tensors, and its output, which the schedule keeps; not its input, a
    receive buffer), the same with blocks recomputed, and the bytes of the activation it sends to the next stage."""
    passes, x = [], inputs
    last = split.num_stages - 1
    for stage in range(last + 1):
        module = view(model, split.units, set(split.stage_units(stage)), stage_class(model))
        received = x.detach().requires_grad_(x.is_floating_point()) if stage else x

        def forward(module=module, received=received, stage=stage):
            out = module(received)
            if stage == last:
                torch.nn.functional.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, targets.flatten())
            return out

        held, kept, recomputed, x = saved_parts(forward, model, blocks, skip=(received,) if stage else ())
        sent = local_tensor(x).nbytes if stage < last else 0
        passes.append({"activation": held + sent, "checkpointed": kept + sent, "recomputed": recomputed,
                       "sent": sent, "loss_gradient": loss_gradient_bytes(x) if stage == last else 0})
    return passes


def in_flight_bytes(passes: list[dict], mine: list[int], counts: list[int], key: str) -> int:
    """The activations a pipeline rank holds at its peak: each of its stages' microbatches in flight; with blocks
    recomputed ("checkpointed"), their inputs and the largest block's own tensors once (one recomputes at a time)."""
    held = sum(count * passes[s][key] for count, s in zip(counts, mine))
    once = max(passes[s]["loss_gradient"] for s in mine)  # the loss's backward: one microbatch's at a time
    return held + once + (max(passes[s]["recomputed"] for s in mine) if key == "checkpointed" else 0)


def drained_bytes(passes: list[dict], mine: list[int], counts: list[int], key: str, microbatches: int) -> int:
    """What a pipeline rank's first backward frees before its stages' gradients are whole: one microbatch's
    activations of the stage it runs backward first (its last), where every forward of the micro-step ran before it
    (gpipe; 1f1b's first rank at the default microbatches); else none, since a forward fills its place before the
    next backward, which starts with the gradients whole (1f1b's steady state; the measured pipeline's peak)."""
    if sum(counts) < len(mine) * microbatches:
        return 0
    return passes[max(mine)][key]


def _sent(dims: ParallelDims, pipeline_rank: int, mine: list[int], passes: list[dict], config: Config,
          machine: Machine, batches: BatchPlan, microbatches: int) -> tuple[float, float]:
    """(intra-node, inter-node) bytes one rank of this pipeline rank sends per step: each stage's output to the next
    stage's rank and the gradient of its input back to the one before, per microbatch, every micro-step. Ranks are
    numbered node by node: a stage's peer is the rank at the same coordinate of the peer's pipeline rank."""
    pp, schedule = config.dist.pipeline_parallel, config.dist.pipeline_schedule
    last = len(passes) - 1
    node = dims.rank_at(pp=pipeline_rank) // machine.nproc_per_node
    intra = inter = 0.0
    for stage in mine:
        sends = ([(stage + 1, passes[stage]["sent"])] if stage < last else []) + \
            ([(stage - 1, passes[stage - 1]["sent"])] if stage > 0 else [])  # the output on, its gradient back
        for peer_stage, nbytes in sends:
            peer = owner_of(peer_stage, pp, schedule)
            if peer == pipeline_rank:
                continue
            total = nbytes * microbatches * batches.grad_accum_steps
            if dims.rank_at(pp=peer) // machine.nproc_per_node == node:
                intra += total
            else:
                inter += total
    return intra, inter


def _buffers(mine: list[int], passes: list[dict], microbatches: int) -> int:
    """torch's receive buffers, one per microbatch, allocated at the first step and kept: a stage after the first
    receives its input and keeps its gradient (until the next step), a stage before the last receives the gradient
    of its output."""
    last = len(passes) - 1
    return microbatches * sum((2 * passes[s - 1]["sent"] if s else 0) + (passes[s]["sent"] if s < last else 0)
                              for s in mine)


def _stage_state(stage: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy,
                 device: torch.device) -> int:
    """The state bytes of one stage's parameters and of their optimizer state."""
    class Held:  # the optimizer's state of this stage's parameters only
        state = {p: optimizer.state[p] for p in stage.parameters() if p in optimizer.state}

    return sum(state_parts_planned(stage, Held, strategy, device).values())


def rank_step(parts: dict, activations: int, buffers: int, gathered: int, unsharded_grads: int, temporaries: int,
              slack: int, grad_accum_steps: int, drained: int) -> Step:
    """A pipeline rank's step; its peak (Step.peak): its state's parameters and optimizer state throughout, and the
    most of: its backwards (the stages' parameters gathered, the receive buffers, the reduced gradients of earlier
    micro-steps, and the more of the activations in flight and, at the first backward's end, their gradients unsharded
    beside the activations less those it freed: `drained`), the reduction at the step's end (the unsharded gradients
    and the reduced ones), and the optimizer's step (the gradients and its temporaries); the allocator's slack."""
    return Step(parts["parameters"], parts["gradients"], parts["optimizer"], activations, gathered, temporaries, 0,
                slack, grad_accum_steps, buffers, unsharded_grads, drained)


def unsharded_gradients(ranked: nn.Module, units: list[str], compute_bytes: int) -> int:
    """The gradients a pipeline rank's units accumulate unsharded across the microbatches (FSDP2 keeps them in float32
    until the last backward reduces them), a tp rank's slice of each. But an embedding tp splits by rows: DTensor
    backs its lookup by replicated gradients (no row-wise rule), so its whole gradient comes out in the compute dtype
    on every tp rank, in its backward, before distrib lays it out as the weight (tensor_parallel._split_gradient;
    a 70B Llama's: 1.96 GiB whole at tp 8, beside its slice's 0.49 GiB in float32)."""
    total = 0
    for unit in units:
        for module in ranked.get_submodule(unit).modules():
            for param in module.parameters(recurse=False):
                local = local_tensor(param).numel()
                whole = isinstance(module, nn.Embedding) and param.numel() != local
                total += 4 * local + (param.numel() * compute_bytes if whole else 0)
    return total


def plan_pipeline(config: Config, strategy: Strategy, info, machine: Machine, device: torch.device,
                  batches: BatchPlan, sample) -> dict:
    """Every pipeline rank's figures (under a fake process group of the world's size; `sample`: the data's first
    samples, distrib.plan.batch) and the fullest rank's, under plan_run's names: `stages` (per pipeline rank: its
    stages' units, state, activations, buffers and sends), `parts` and `local_parameters` of the rank with the most
    state, and the peak terms of the rank with the highest peak."""
    dist_config, pp = config.dist, config.dist.pipeline_parallel
    per_rank, microbatches = dist_config.stages_per_rank, pipeline.microbatches(dist_config)
    model = meta_model(config, info)
    split = split_stages(model, pp * per_rank, dist_config.pipeline_split, pp)
    staged_inputs(sample, pp)
    strategy.dims.build_mesh("cpu")  # a degree's cut of the batch may need its group (context parallel's attend)
    inputs, targets = rank_batch(shaped_batch(sample, batches.micro_batch_size // microbatches), strategy.dims)
    # the passes as rank 0 runs them: its slices of the tensors, the target's attention kernel
    runtime = Runtime(0, 0, machine.world_size, machine.nproc_per_node, device, "fake")
    ranked = split_as_run(meta_model(config, info), strategy.dims, config, runtime)
    with target_attention(device), one_tensor(inputs) as tokens:
        passes = stage_passes(ranked, split, fsdp.find_blocks(ranked, dist_config.shard_modules), tokens, targets)
    key = "checkpointed" if config.speed.activation_checkpointing == "blocks" else "activation"
    slack_share = 0.0 if device.type != "cpu" or returns_freed_memory(strategy, model) else KEPT_SLACK
    ranks = []
    for pipeline_rank in range(pp):
        first_rank = strategy.dims.rank_at(pp=pipeline_rank)  # its data-parallel rank 0's: the fullest shards
        held, optimizer = planned_rank(config, strategy, info, machine, device, first_rank)
        mine = stages_of(pipeline_rank, pp, per_rank, dist_config.pipeline_schedule)
        counts = in_flight(dist_config.pipeline_schedule, pp, per_rank, microbatches, pipeline_rank)
        parts, local = state_parts_planned(held, optimizer, strategy, device), local_parameters(held)
        units = [u for s in mine for u in split.stage_units(s)]
        compute = next(model.parameters()).element_size()
        gathered = sum(local_tensor(p).numel() for u in units for p in ranked.get_submodule(u).parameters()) * compute
        activations = in_flight_bytes(passes, mine, counts, key)
        figures = {"parameter_bytes": parts["parameters"], "gradient_bytes": parts["gradients"],
                   "optimizer_bytes": parts["optimizer"], "state_bytes": sum(parts.values()),
                   "activation_bytes_in_flight": activations, "buffer_bytes": _buffers(mine, passes, microbatches),
                   "gathered_bytes": gathered, "unsharded_gradient_bytes": unsharded_gradients(ranked, units, compute),
                   "optimizer_temporary_bytes": optimizer_temporaries(config, local)}
        figures["allocator_slack_bytes"] = round(slack_share * (activations + gathered
                                                                + figures["unsharded_gradient_bytes"]))
        step = rank_step(parts, activations, figures["buffer_bytes"], gathered, figures["unsharded_gradient_bytes"],
                         figures["optimizer_temporary_bytes"], figures["allocator_slack_bytes"],
                         batches.grad_accum_steps, drained_bytes(passes, mine, counts, key, microbatches))
        figures["memory_bytes"] = step.peak
        intra, inter = _sent(strategy.dims, pipeline_rank, mine, passes, config, machine, batches, microbatches)
        stages = [{"stage": s, "units": list(split.stage_units(s)),
                   "state_bytes": _stage_state(strategy.runner.stages[s], optimizer, strategy, device),
                   "activation_bytes_per_microbatch": passes[s][key], "microbatches_in_flight": count}
                  for s, count in zip(mine, counts)]
        ranks.append({"pipeline_rank": pipeline_rank, **figures, "sent_bytes_per_step_intra_node": intra,
                      "sent_bytes_per_step_inter_node": inter, "stages": stages, "_parts": parts, "_local": local,
                      "_experts": held_experts(held, optimizer), "_step": step,
                      "_checkpointed": in_flight_bytes(passes, mine, counts, "checkpointed"),
                      "_drained_checkpointed": drained_bytes(passes, mine, counts, "checkpointed", microbatches)})
    return _fullest(ranks, pp, microbatches, per_rank, dist_config.pipeline_schedule)


def _fullest(ranks: list[dict], pp: int, microbatches: int, per_rank: int, schedule: str) -> dict:
    """plan_run's pipeline figures: the state of the rank with the most (what summary.json's maximum over ranks
    measures), the peak of the rank with the highest, and the sends of the rank that sends the most."""
    by_state = max(ranks, key=lambda rank: rank["state_bytes"])
    by_peak = max(ranks, key=lambda rank: rank["memory_bytes"])
    by_sends = max(ranks, key=lambda rank: rank["sent_bytes_per_step_intra_node"]
                   + rank["sent_bytes_per_step_inter_node"])
    by_experts = max(ranks, key=lambda rank: rank["_experts"]["expert_state_bytes_per_rank"])
    return {"parts": by_state["_parts"], "local_parameters": by_state["_local"], "experts": by_experts["_experts"],
            "memory_bytes_per_rank": by_peak["memory_bytes"],
            "steps": [(rank["_step"], rank["_checkpointed"], rank["_drained_checkpointed"])  # each rank's, for its
                      for rank in ranks],  # fixes
            "peak": {"gathered_bytes_per_rank": by_peak["gathered_bytes"],
                     "optimizer_temporary_bytes_per_rank": by_peak["optimizer_temporary_bytes"],
                     "allocator_slack_bytes_per_rank": by_peak["allocator_slack_bytes"]},
            "figures": {"pipeline_parallel": pp, "pipeline_schedule": schedule, "pipeline_microbatches": microbatches,
                        "pipeline_stages_per_rank": per_rank,
                        "bubble_share": bubble_share(pp, microbatches, per_rank),
                        "activation_bytes_in_flight_per_rank": by_peak["activation_bytes_in_flight"],
                        "pipeline_buffer_bytes_per_rank": by_peak["buffer_bytes"],
                        "unsharded_gradient_bytes_per_rank": by_peak["unsharded_gradient_bytes"],
                        "pipeline_bytes_per_step_intra_node": by_sends["sent_bytes_per_step_intra_node"],
                        "pipeline_bytes_per_step_inter_node": by_sends["sent_bytes_per_step_inter_node"],
                        "stages": [{k: v for k, v in rank.items() if not k.startswith("_")} for rank in ranks]}}


def no_pipeline(config: Config, activations: int) -> dict:
    """The pipeline figures of a run without one: one stage, no bubble, nothing sent between stages."""
    return {"pipeline_parallel": 1, "pipeline_schedule": config.dist.pipeline_schedule, "pipeline_microbatches": 1,
            "pipeline_stages_per_rank": 1, "bubble_share": 0.0, "activation_bytes_in_flight_per_rank": activations,
            "pipeline_buffer_bytes_per_rank": 0, "unsharded_gradient_bytes_per_rank": 0,
            "pipeline_bytes_per_step_intra_node": 0, "pipeline_bytes_per_step_inter_node": 0, "stages": []}
