"""`distrib plan`: what each rank of a run of this config would hold and send, at any world size, before booking it.

The model is built on the meta device (nothing allocated) and laid out by the run's own calls (Strategy.plan_module)
over torch's fake process group of the asked world size, so per-rank bytes are the real plan's DTensor shards; the
optimizer steps once on meta to create its state. Activations come from one meta forward that counts the tensors
autograd saves, of rank 0's slices and with the target's attention kernel (distrib.plan.activations); collective bytes
from the mesh (distrib.plan.cost).

Here the entry (plan_run, main) and the public names; the parts: machine (the cluster asked about, the fake world),
rank (a rank's model and state on meta), saved (what autograd saves), traffic and cost (what a step sends), peak (its
peak term by term, the fixes), report (the printed table), pipeline and experts, dry_run (the measured step)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn as nn

from distrib.config import Config
from distrib.data import load_data
from distrib.data.batching import BatchPlan
from distrib.data.split import split_validation
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import Strategy, make_strategy
from distrib.plan.batch import first_samples, num_tokens, shaped_batch
from distrib.plan.cost import collectives, named_traffic, step_traffic
from distrib.plan.experts import MetaRouting, autocast_on_meta, expert_plan
from distrib.plan.goodput import plan_goodput
from distrib.plan.host import described_allocator
from distrib.plan.machine import GB, GIB, Machine, fake_process_group, mesh_machine
from distrib.plan.peak import memory_figures, peak_terms, plan_fixes, planned_step
from distrib.plan.pipeline import no_pipeline, plan_pipeline
from distrib.plan.rank import meta_model, rank_activations, sharded_state
from distrib.plan.report import table
from distrib.plan.traffic import traffic_terms

__all__ = ["GB", "GIB", "Machine", "fake_process_group", "main", "plan_run", "table"]


@dataclass(frozen=True)
class _LaidOut:
    """What plan_run reads off the layout: the fullest rank's state parts, local parameters and experts, every
    pipeline rank's figures (None without a pipeline), the whole model on meta, a micro-batch's inputs, rank 0's
    activations (as is, and with its blocks recomputed) and the elements its forward sends."""

    parts: dict
    local_params: int
    held: dict
    pipeline: dict | None
    model: nn.Module
    inputs: object
    whole: int
    recomputed: int
    sent: int


def plan_run(config: Config, machine: Machine) -> dict:
    """The figures of the plan, under summary.json's names where it has them. UserErrors are train's own."""
    mesh = mesh_machine(config, machine)  # the ranks one mesh spans (a replica group's)
    strategy = make_strategy(config.dist, mesh.world_size, mesh.nproc_per_node)
    shape = strategy.dims
    device = torch.device("cpu" if config.dist.device == "cpu" else "cuda")
    one = Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo")
    data = split_validation(load_data(config.data, one, config.train.seed, log=lambda message: None), config.data)
    batches = BatchPlan(data.train.num_samples, config.train.global_batch_size, config.train.grad_accum_steps, 0,
                        shape.batch_ranks, config.train.seed)
    laid = _lay_out(config, strategy, data.info, machine, device, batches,
                    first_samples(data.train, batches.micro_batch_size))
    traffic = traffic_terms(config, shape, machine.nproc_per_node, laid.model, laid.inputs, laid.local_params,
                            laid.held["expert_parameter_bytes_per_rank"], laid.sent)
    experts = expert_plan(laid.held, shape, machine.nproc_per_node, num_tokens(laid.inputs),
                          2 if config.train.precision == "bf16" else 4, config.train.grad_accum_steps,
                          config.speed.activation_checkpointing == "blocks")
    peak, needed, staged, memory, fixed = _memory(config, strategy, machine, data.info, laid, device)
    intra, inter = step_traffic(*traffic)
    intra = intra + experts["all_to_all_bytes_per_step_intra_node"] + staged["pipeline_bytes_per_step_intra_node"]
    inter = inter + experts["all_to_all_bytes_per_step_inter_node"] + staged["pipeline_bytes_per_step_inter_node"]
    bound = max(intra / machine.intra_node_bandwidth, inter / machine.inter_node_bandwidth)
    parts, model = laid.parts, laid.model
    return {"world_size": machine.world_size, "nnodes": machine.nnodes, "nproc_per_node": machine.nproc_per_node,
            "strategy": config.dist.strategy, "mesh": shape.layout(),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "parameter_bytes_per_rank": parts["parameters"], "gradient_bytes_per_rank": parts["gradients"],
            "optimizer_bytes_per_rank": parts["optimizer"], "state_bytes_per_rank": sum(parts.values()),
            "activation_bytes_per_micro_batch": laid.whole,
            "activation_bytes_per_micro_batch_checkpointed": laid.recomputed,
            "global_batch_size": batches.global_batch_size, "micro_batch_size": batches.micro_batch_size,
            "grad_accum_steps": batches.grad_accum_steps, "data_parallel_size": shape.batch_ranks,
            "collective_bytes_per_step_intra_node": intra, "collective_bytes_per_step_inter_node": inter,
            "named_collectives": named_traffic(*traffic),
            "collectives": collectives(*traffic, experts=experts, staged=staged),
            "device_memory_bytes": machine.device_memory, "memory_bytes_per_rank": needed, **peak,
            "host_allocator": described_allocator(strategy, model) if device.type == "cpu" else "",
            **memory, **staged, **experts, "fixes": fixed, "step_seconds_lower_bound": bound,
            **plan_goodput(config, machine, shape.layout(), parts["parameters"] + parts["optimizer"], bound)}


def _lay_out(config: Config, strategy: Strategy, info, machine: Machine, device: torch.device, batches: BatchPlan,
             sample) -> _LaidOut:
    """The run laid out over a fake group of the mesh's ranks: the fullest rank's state (every pipeline rank's
    stages under pp), and rank 0's forward of a micro-batch shaped as `sample` (the data's first samples)."""
    mesh, shape, pipeline = mesh_machine(config, machine), strategy.dims, None
    # MetaRouting: an MoE layer's meta passes; autocast_on_meta: peft's LoRA on its experts, on meta
    with fake_process_group(mesh.world_size), MetaRouting(), autocast_on_meta():
        if shape.pipeline > 1:  # every pipeline rank's stages: the fullest rank's state
            pipeline = plan_pipeline(config, strategy, info, machine, device, batches, sample)
            parts, local_params, held = pipeline["parts"], pipeline["local_parameters"], pipeline["experts"]
        else:
            parts, local_params, held = sharded_state(config, strategy, info, mesh, device)
        model = meta_model(config, info)
        inputs, targets = shaped_batch(sample, batches.micro_batch_size)
        whole, recomputed, sent = rank_activations(config, strategy, info, mesh, device, inputs, targets)
    return _LaidOut(parts, local_params, held, pipeline, model, inputs, whole, recomputed, sent)


def _memory(config: Config, strategy: Strategy, machine: Machine, info, laid: _LaidOut, device: torch.device
            ) -> tuple[dict, int, dict, dict, list[dict]]:
    """The step's peak terms and its peak (the highest pipeline rank's under pp), the pipeline's figures, start-up
    and host memory beside it, and the fixes where it does not fit."""
    parts, model, pipeline = laid.parts, laid.model, laid.pipeline
    activations = laid.recomputed if config.speed.activation_checkpointing == "blocks" else laid.whole
    peak = peak_terms(config, strategy, model, activations, laid.local_params, device, parts["gradients"])
    step = planned_step(parts, activations, peak, config.train.grad_accum_steps)
    needed = step.peak
    staged = pipeline["figures"] if pipeline else no_pipeline(config, activations)
    if pipeline:  # the highest pipeline rank's peak; the activations sent between stages on top of the collectives
        peak, needed = {**pipeline["peak"], "ddp_bucket_bytes_per_rank": 0}, pipeline["memory_bytes_per_rank"]
    memory = memory_figures(config, strategy, machine, info, parts, needed, device)
    fixing = (pipeline["steps"], staged["pipeline_microbatches"]) if pipeline else ([(step, laid.recomputed)], 1)
    fixed = [] if memory["fits"] else plan_fixes(config, strategy, machine, model, *fixing, device)
    return peak, needed, staged, memory, fixed


def main(config: Config, machine: Machine, as_json: bool) -> int:
    figures = plan_run(config, machine)
    print(json.dumps(figures, indent=1) if as_json else table(figures, machine))
    return 0
