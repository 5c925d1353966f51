"""A step's peak per rank, term by term (Step): what it holds beyond its state and activations (the parameters gathered
in flight, the optimizer's temporaries, DDP's buckets, the allocator's slack), start-up, host memory and the end-of-run
save beside it, and, where it does not fit, the fixes that would make it (distrib.plan.fixes)."""

from __future__ import annotations

import torch
import torch.nn as nn

from distrib.config import Config
from distrib.distributed import fsdp
from distrib.distributed.strategies import Strategy
from distrib.plan.cost import startup_memory
from distrib.plan.fixes import Run, Step, fixes
from distrib.plan.host import allocator_slack
from distrib.plan.machine import Machine
from distrib.plan.rank import whole_model
from distrib.plan.saved import tensor_bytes

# What a step holds beyond its state and activations (README, "What plan counts"; measured by scripts/bench_allocator.py
# and tests/integration/test_meta_build.py). Under fsdp, at a block's backward: two blocks' bytes, its gathered
# parameters and its unsharded gradients, then those gradients and the reduce-scatter's copy of them (FSDP2 reshards
# the parameters first); an accelerator also prefetches the next block's parameters (on the CPU distrib turns that off:
# distrib.distributed.fsdp.shard). The root unit (what no block holds: embeddings, the output layer, the final norm)
# stays gathered from its forward to its backward.
BLOCKS_IN_FLIGHT = {"cpu": 2, "accelerator": 3}


def gathered_bytes(config: Config, model: nn.Module, device: torch.device, tensor_parallel: int = 1) -> int:
    """The parameters a sharded strategy gathers in flight per rank: the root unit and BLOCKS_IN_FLIGHT of the
    largest block, in the compute dtype, a tensor-parallel rank's slice."""
    blocks = fsdp.find_blocks(model, config.dist.shard_modules)
    others = fsdp.leftover_units(model, blocks)  # units of their own too: an untied embedding, output layer
    in_units = {id(p) for unit in [*blocks, *others] for p in unit.parameters()}
    root = sum(tensor_bytes(p) for p in model.parameters() if id(p) not in in_units)
    largest = max((sum(tensor_bytes(p) for p in block.parameters()) for block in blocks), default=0)
    in_flight = BLOCKS_IN_FLIGHT["cpu" if device.type == "cpu" else "accelerator"]
    # such a unit counted once: a Llama-shaped 106M GPT (the embedding and the output layer each 0.23x of it)
    # measured 0.97-1.10x above a tiny run, plan 1.23x so, 1.47x counting two of it as two blocks
    other = max((sum(tensor_bytes(p) for p in unit.parameters()) for unit in others), default=0)
    return (root + max(in_flight * largest, other)) // tensor_parallel


def peak_terms(config: Config, strategy: Strategy, model: nn.Module, activations: int, local_params: int,
               device: torch.device, gradient_bytes: int = 0) -> dict:
    """What a step holds beyond its state and its activations, per rank: parameters gathered in flight (sharded
    strategies: gathered_bytes), the optimizer's temporaries (one chunk: distrib.training.optimizers), DDP's
    gradient buckets (a copy of the gradients, unless speed.gradient_as_bucket_view makes the gradients views of
    them) and the allocator's slack."""
    tp = strategy.dims.tensor_parallel
    gathered = gathered_bytes(config, model, device, tp) if strategy.sharded_state else 0
    buckets = 0 if strategy.sharded_state or config.speed.gradient_as_bucket_view else gradient_bytes
    return {"gathered_bytes_per_rank": gathered,
            "optimizer_temporary_bytes_per_rank": optimizer_temporaries(config, local_params),
            "ddp_bucket_bytes_per_rank": buckets,
            "allocator_slack_bytes_per_rank": allocator_slack(model, device, strategy.sharded_state,
                                                              activations + gathered, tp)}


def optimizer_temporaries(config: Config, local_params: int) -> int:
    """The optimizer's temporaries at its step: one chunk of the local parameters (distrib.training.optimizers)."""
    from distrib.training.optimizers import MAX_CHUNKS, MIN_CHUNK_ELEMENTS

    if config.train.optimizer == "sgd" and not config.train.weight_decay:
        return 0
    return min(4 * max(MIN_CHUNK_ELEMENTS, -(-local_params // MAX_CHUNKS)), 4 * local_params)


def planned_step(parts: dict, activations: int, terms: dict, grad_accum_steps: int) -> Step:
    """The step's terms per rank; its peak (memory_bytes_per_rank) is Step.peak: what a step holds, term by term."""
    return Step(parts["parameters"], parts["gradients"], parts["optimizer"], activations,
                terms["gathered_bytes_per_rank"], terms["optimizer_temporary_bytes_per_rank"],
                terms["ddp_bucket_bytes_per_rank"], terms["allocator_slack_bytes_per_rank"], grad_accum_steps)


def memory_figures(config: Config, strategy: Strategy, machine: Machine, info, parts: dict, needed: int,
                   device: torch.device) -> dict:
    """Start-up beside steady state, device memory per rank beside host memory per node, and what does not fit."""
    whole, largest, self_init = whole_model(config, info)
    loads = bool(config.model.init_from)  # the shards are read from the file: no whole copy either, a block at a time
    params_on_host = device.type == "cpu" or strategy.state_on_host
    startup, startup_host = startup_memory(strategy.dims, parts["parameters"], whole, largest, self_init or loads,
                                           machine.nproc_per_node, params_on_host)
    state = sum(parts.values())
    # In steady state the host holds each rank's all (a CPU run) or its offloaded state shards.
    steady_host = machine.nproc_per_node * (needed if device.type == "cpu" else state if strategy.state_on_host else 0)
    save = end_of_run_save(config, strategy, whole)  # into host memory, beside each rank's state there
    save_host = save + (machine.nproc_per_node * state if params_on_host else 0)
    host = max(startup_host, steady_host, save_host)
    # at start-up an accelerator holds its shards under a sharded strategy (a whole copy is on a host), else the model
    on_device = parts["parameters"] if strategy.sharded_state else startup
    return {"startup_bytes_per_rank": startup, "startup_host_bytes_per_node": startup_host,
            "host_bytes_per_node": steady_host, "save_bytes_rank0": save, "save_host_bytes_per_node": save_host,
            "host_memory_bytes": machine.host_memory,
            "whole_model_bytes": whole, "self_initialising": self_init, "loads_weights": loads,
            "fits": needed <= machine.device_memory and (device.type == "cpu" or on_device <= machine.device_memory),
            "fits_host": host <= machine.host_memory}


def end_of_run_save(config: Config, strategy: Strategy, whole_bytes: int) -> int:
    """What rank 0 holds above the other ranks at the run's end (distrib.checkpoint.weights.write_run_weights): every
    rank writes its own blocks of weights/, but under a sharded strategy model.pt, where it is written (at most one
    weights file: model.max_shard_size), is gathered whole on rank 0, then model_ema.pt, one at a time."""
    from distrib.checkpoint.weights import model_pt_written

    sharded = strategy.sharded_state
    return whole_bytes if sharded and model_pt_written(whole_bytes, sharded, config.model.max_shard_bytes) else 0


def plan_fixes(config: Config, strategy: Strategy, machine: Machine, model: nn.Module, steps: list[tuple],
               microbatches: int, device: torch.device) -> list[dict]:
    """What would make a run that does not fit the device fit (distrib.plan.fixes), each with its peak. steps: (the
    step, its activations with blocks recomputed[, what its first backward frees of those]) of the run, or of each
    pipeline rank."""
    shape = strategy.dims
    gathered = gathered_bytes(config, model, device, shape.tensor_parallel)

    def run(step: Step, checkpointed: int, drained_checkpointed: int = 0) -> Run:
        share = step.slack / max(1, step.activations + step.gathered + (step.unsharded or 0))

        def slack(activations: int, gathered: int, sharded: bool) -> int:
            if step.unsharded is not None:  # a pipeline rank's: its share of what it frees (distrib.plan.pipeline)
                return round(share * (activations + gathered + step.unsharded))
            return allocator_slack(model, device, sharded, activations + gathered, shape.tensor_parallel)

        return Run(step, checkpointed, config.speed.activation_checkpointing == "blocks", strategy.sharded_state,
                   config.train.global_batch_size, shape.data_parallel, shape.shard if strategy.sharded_state else 1,
                   machine.nnodes, device.type != "cpu", strategy.state_on_host, gathered, slack, microbatches,
                   drained_checkpointed)

    return fixes([run(*step) for step in steps], machine.device_memory)
