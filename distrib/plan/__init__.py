"""`distrib plan`: what each rank of a run of this config would hold and send, at any world size, before booking it.

The model is built on the meta device (nothing allocated) and laid out by the run's own calls (Strategy.plan_module)
over torch's fake process group of the asked world size, so per-rank bytes are the real plan's DTensor shards; the
optimizer steps once on meta to create its state. Activations come from one meta forward that counts the tensors
autograd saves, of rank 0's slices and with the target's attention kernel (distrib.plan.activations); collective bytes
from the mesh (distrib.plan.cost)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.nn as nn

from distrib.config import Config
from distrib.data import load_data
from distrib.data.batching import BatchPlan
from distrib.data.split import split_validation
from distrib.distributed import dimensions, fsdp
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import local_tensor, state_parts
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import Strategy, make_strategy
from distrib.distributed.strategies.materialise import initialises_itself
from distrib.distributed.tensor_parallel import layers_split
from distrib.models.build import build_model
from distrib.plan.activations import rank_batch, split_as_run, target_attention
from distrib.plan.batch import first_samples, num_tokens, positions, shaped_batch
from distrib.plan.cost import collective_rows, collectives, named_traffic, startup_memory, step_traffic
from distrib.plan.experts import MetaRouting, autocast_on_meta, expert_plan, expert_rows, held_experts
from distrib.plan.fixes import Run, Step, fixes
from distrib.plan.goodput import Failures, plan_goodput
from distrib.plan.goodput import rows as goodput_rows
from distrib.plan.host import (  # noqa: F401 - distrib.plan's names too
    KEPT_SLACK,
    SHARDED_KEPT_SLACK,
    allocator_slack,
    described_allocator,
    host_allocator,
    returns_freed_memory,
)
from distrib.torch_private import register_fake_backend, storage_id, view_base
from distrib.training.losses import Loss, build_loss, cross_entropy, forward, own_loss
from distrib.training.trainer import build_optimizer

GIB, GB = 2**30, 1e9
# What a step holds beyond its state and activations (README, "What plan counts"; measured by scripts/bench_allocator.py
# and tests/integration/test_meta_build.py). Under fsdp, at a block's backward: two blocks' bytes, its gathered
# parameters and its unsharded gradients, then those gradients and the reduce-scatter's copy of them (FSDP2 reshards
# the parameters first); an accelerator also prefetches the next block's parameters (on the CPU distrib turns that off:
# distrib.distributed.fsdp.shard). The root unit (what no block holds: embeddings, the output layer, the final norm)
# stays gathered from its forward to its backward.
BLOCKS_IN_FLIGHT = {"cpu": 2, "accelerator": 3}


@dataclass(frozen=True, slots=True)
class Machine:
    """The cluster asked about; the defaults are H100/H200 nodes (NVLink 4: 450 GB/s per GPU and direction;
    one 400 Gb/s NIC per GPU: 50 GB/s; 80 GiB per GPU, 2 TiB of host memory per node)."""

    nnodes: int
    nproc_per_node: int
    device_memory: float = 80 * GIB
    intra_node_bandwidth: float = 450 * GB
    inter_node_bandwidth: float = 50 * GB
    host_memory: float = 2048 * GIB  # per node: a DGX H100's 2 TiB
    failures: Failures = Failures()  # failure rate, restart, checkpoint storage: the goodput line (plan.goodput)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Rank 0 of a fake group of world_size ranks: collectives return at once, meshes of any shape can be built."""
    import torch.distributed as dist
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def activation_bytes(model: nn.Module, inputs, targets, blocks: list[nn.Module], loss: Loss | None = None
                     ) -> tuple[int, int]:
    """Bytes autograd keeps for backward after one forward of this micro-batch (parameters not counted, each
    storage once): as is, and with each block recomputed (speed.activation_checkpointing = blocks: a block keeps
    only its input, and one block's own tensors live again while it is recomputed). The loss is the model's own where
    it returns one (as the trainer takes it), else `loss` (cross-entropy where none is given)."""
    loss = loss or cross_entropy()

    def forward_and_loss():
        outputs = forward(model, inputs)  # a dict sample as model(**inputs)
        if own_loss(outputs) is None or loss.whole:
            loss(outputs, targets)
            return getattr(outputs, "logits", outputs)
        return None

    whole, recomputed, logits = saved_bytes(forward_and_loss, model, blocks)
    transient = loss_gradient_bytes(logits) if isinstance(logits, torch.Tensor) else 0
    return whole + transient, recomputed + transient


def loss_gradient_bytes(logits: torch.Tensor) -> int:
    """What the loss's backward holds beside the saved tensors, at the step's peak when blocks are recomputed: the
    float32 gradient of the logits twice at once (cross-entropy's nll_loss gradient and log_softmax's), a tp rank's
    logits (whole where gathered)."""
    return 8 * local_tensor(logits).numel()


def saved_bytes(forward, model: nn.Module, blocks: list[nn.Module], skip: tuple[torch.Tensor, ...] = ()
                ) -> tuple[int, int, object]:
    """activation_bytes' count for any forward: the bytes autograd saves while `forward()` runs, neither the model's
    parameters nor the tensors in `skip` (each storage once); the same with each block recomputed; and what forward
    returned."""
    whole, kept, recomputed, returned = saved_parts(forward, model, blocks, skip)
    return whole, kept + recomputed, returned


def saved_parts(forward, model: nn.Module, blocks: list[nn.Module], skip: tuple[torch.Tensor, ...] = ()
                ) -> tuple[int, int, int, object]:
    """saved_bytes with each block recomputed in two parts: what stays until the backward (the blocks' inputs and
    what no block saves) and the most one block saves again while it is recomputed (once per rank, whatever number
    of microbatches a pipeline keeps in flight: one block recomputes at a time)."""
    params = {id(p) for p in model.parameters()}
    skipped = {storage_id(local_tensor(t)) for t in skip} | {storage_id(local_tensor(p)) for p in model.parameters()}
    saved: dict[tuple, tuple[int, int]] = {}  # storage -> (bytes, index of the block that saved it, -1: none)
    block_inputs, current = [], [-1]

    def pack(tensor):
        base, local = view_base(tensor), local_tensor(tensor)  # a split model's DTensors: this rank's slice
        if id(tensor) not in params and not (base is not None and id(base) in params) \
                and storage_id(local) not in skipped:
            key = (storage_id(local), local.storage_offset(), tuple(local.shape))
            saved.setdefault(key, (_nbytes(local), current[0]))
        return tensor

    def enter(index):
        def hook(module, args):
            current[0] = index
            block_inputs.append(sum(_nbytes(local_tensor(a)) for a in args if isinstance(a, torch.Tensor)))
        return hook

    handles = [block.register_forward_pre_hook(enter(i)) for i, block in enumerate(blocks)]
    handles += [block.register_forward_hook(lambda *_: current.__setitem__(0, -1)) for block in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            returned = forward()
    finally:
        for handle in handles:
            handle.remove()
    whole = sum(size for size, _ in saved.values())
    per_block = [sum(size for size, owner in saved.values() if owner == i) for i in range(len(blocks))]
    outside = whole - sum(per_block)
    return whole, outside + sum(block_inputs), max(per_block, default=0), returned


def rank_activations(config: Config, strategy: Strategy, info, machine: Machine, device: torch.device, inputs,
                     targets) -> tuple[int, int, int]:
    """activation_bytes of rank 0's forward as the target runs it: the model split as the run splits its tensors,
    the micro-batch cut as the run cuts it, attention by the device's kernel (distrib.plan.activations); and the
    elements the degrees send per forward (dimensions.counted: context parallel's keys and values)."""
    runtime = Runtime(0, 0, machine.world_size, machine.nproc_per_node, device, "fake")
    model = split_as_run(meta_model(config, info), strategy.dims, config, runtime)
    inputs, targets = rank_batch((inputs, targets), strategy.dims)
    inputs, sent = dimensions.counted(inputs, strategy.dims)
    with target_attention(device):
        whole, recomputed = activation_bytes(model, inputs, targets, fsdp.find_blocks(model, config.dist.shard_modules),
                                             build_loss(config.train))
    return whole, recomputed, sent()


def _context_bytes(config: Config, dims: ParallelDims, own: int) -> tuple[int, int]:
    """(all-gathered, reduce-scattered) bytes of a rank's own keys and values a pass (StepCost.context_bytes), from
    `own`, the whole model's over one micro-batch (rank_activations' forward): a pipeline rank runs 1/pp of the
    layers, and a pass is one of the degrees' pieces of the micro-batch (a pipeline's microbatches); the all-gather
    again in each block's recomputation."""
    pieces = math.prod(dimension.passes(dims, config.dist) for dimension in dimensions.DIMENSIONS)
    own = own / (dims.pipeline * pieces)
    return own * (2 if config.speed.activation_checkpointing == "blocks" else 1), own


def meta_model(config: Config, info) -> nn.Module:
    torch.manual_seed(config.train.seed)
    with torch.device("meta"):
        model = build_model(config.model, info)
    return model.to(torch.bfloat16) if config.train.precision == "bf16" else model


def _sharded_state(config: Config, strategy: Strategy, info, machine: Machine, device: torch.device
                   ) -> tuple[dict, int, dict]:
    """Rank 0's bytes of parameters, gradients and optimizer state (the fullest rank: shards are chunks, rank 0's
    the largest), the parameters it holds, and its part of the experts (distrib.plan.experts.held_experts)."""
    model, optimizer = planned_rank(config, strategy, info, machine, device, 0)
    return (state_parts_planned(model, optimizer, strategy, device), local_parameters(model),
            held_experts(model, optimizer))


def mesh_machine(config: Config, machine: Machine) -> Machine:
    """The ranks one mesh spans: the machine's, or one of the worlds a degree splits them into (fault-tolerant replica
    groups: world / G ranks each, on whole nodes or within one), a one-line ConfigError when they do not tile it."""
    worlds = dimensions.worlds(config.dist, machine.world_size, machine.nproc_per_node)
    ranks = machine.world_size // worlds
    return machine if worlds == 1 else replace(machine, nnodes=max(1, ranks // machine.nproc_per_node),
                                               nproc_per_node=min(ranks, machine.nproc_per_node))


def planned_rank(config: Config, strategy: Strategy, info, machine: Machine, device: torch.device, rank: int
                 ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model as `rank` holds it (its shards on meta, over the fake group of rank 0: the data-parallel coordinates
    are rank 0's) and its optimizer after one step on meta."""
    torch.manual_seed(config.train.seed)
    with torch.device("meta"):
        model = build_model(config.model, info)
    runtime = Runtime(rank, rank % machine.nproc_per_node, machine.world_size, machine.nproc_per_node, device, "fake")
    model = strategy.plan_module(model, runtime, config.train.precision)
    optimizer = build_optimizer(model, config.train)
    for group in optimizer.param_groups:  # the same state; DTensor's sharding rules cache per-tensor ops, not
        if "foreach" in group:            # foreach lists: 3 s instead of 14 s for an 8B GPT's first step on meta
            group["foreach"] = False
    for param in model.parameters():
        param.grad = torch.zeros_like(param) if param.requires_grad else None
    optimizer.step()  # creates the optimizer's state (momenta, moments, step counts) on meta, as a first step would
    return model, optimizer


def local_parameters(model: nn.Module) -> int:
    return sum(local_tensor(p).numel() for p in model.parameters())


def state_parts_planned(model: nn.Module, optimizer, strategy: Strategy, device: torch.device) -> dict:
    """state_parts of a planned model. dist.cpu_offload on an accelerator: the shards live in host memory, and the
    device holds none of them."""
    offloaded = strategy.state_on_host and device.type != "cpu"
    return state_parts(model, optimizer, device, planned=not offloaded)


def _root_share(model: nn.Module, config: Config, tensor_parallel: int) -> float:
    """The share of a rank's parameters outside the model's blocks (FSDP2 units of their own, or the root's), those
    that tensor parallel splits counted 1/tp."""
    split = {id(p) for style in ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")
             for m in layers_split(model, style) for p in m.parameters()} if tensor_parallel > 1 else set()
    blocks = fsdp.find_blocks(model, config.dist.shard_modules)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    held = {id(p): p.numel() / (tensor_parallel if id(p) in split else 1) for p in model.parameters()}
    total = sum(held.values())
    return 1 - sum(held[key] for key in in_blocks) / total if total else 0.0


def _recomputed_rowwise(block: nn.Module, rowwise: set[int]) -> int:
    """The row-wise outputs a checkpointed block's recompute all-reduces again (rowwise: the ids of the model's
    row-wise layers): all but its last one's, whose output no backward needs (torch's recompute stops before it;
    counted in runs: scripts/bench_traffic.py)."""
    held = [m for m in block.modules() if id(m) in rowwise]
    return sum(m.out_features for m in held[:-1])


def _tp_activations(model: nn.Module, shape: ParallelDims, inputs, config: Config) -> float:
    """Elements tensor parallel all-reduces per forward pass (a pipeline's microbatch) of one pipeline rank's layers,
    as counted in a run (scripts/bench_traffic.py): each row-wise layer's output in forward (again when activation
    checkpointing recomputes it) and each column-wise layer's input gradient in backward (wq, wk and wv apiece); a
    row-wise embedding's output in forward; a gathered column-wise output (an lm_head's logits) gathered in forward,
    half an all-reduce's traffic, and its input gradient all-reduced in backward. A pipeline rank holds 1/pp of the
    layers (an even split)."""
    if shape.tensor_parallel == 1:
        return 0
    split = layers_split(model, "rowwise")
    rowwise = sum(m.out_features for m in split)
    if config.speed.activation_checkpointing == "blocks":  # torch's recompute stops at the last tensor backward needs
        ids = {id(m) for m in split}
        rowwise += sum(_recomputed_rowwise(block, ids) for block in fsdp.find_blocks(model, config.dist.shard_modules))
    colwise = sum(m.in_features for m in layers_split(model, "colwise"))
    embedding = sum(m.embedding_dim for m in layers_split(model, "embedding_rowwise"))
    gathered = sum(m.out_features / 2 + m.in_features for m in layers_split(model, "colwise_gather_output"))
    microbatches = dimensions.pipeline.microbatches(config.dist) if shape.pipeline > 1 else 1
    return positions(inputs) / microbatches * (rowwise + colwise + embedding + gathered) / shape.pipeline


def _whole_model(config: Config, info) -> tuple[int, int, bool]:
    """Bytes of the whole model's parameters and buffers (tied ones once), of its largest tensor, and whether it
    initialises itself (then no rank ever builds it whole under sharded strategies)."""
    torch.manual_seed(config.train.seed)
    with torch.device("meta"):
        model = build_model(config.model, info)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(map(_nbytes, tensors)), max(map(_nbytes, tensors)), initialises_itself(model)


def _memory_figures(config: Config, strategy: Strategy, machine: Machine, info, parts: dict, needed: int,
                    device: torch.device) -> dict:
    """Start-up beside steady state, device memory per rank beside host memory per node, and what does not fit."""
    whole, largest, self_init = _whole_model(config, info)
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


def gathered_bytes(config: Config, model: nn.Module, device: torch.device, tensor_parallel: int = 1) -> int:
    """The parameters a sharded strategy gathers in flight per rank: the root unit and BLOCKS_IN_FLIGHT of the
    largest block, in the compute dtype, a tensor-parallel rank's slice."""
    blocks = fsdp.find_blocks(model, config.dist.shard_modules)
    others = fsdp.leftover_units(model, blocks)  # units of their own too: an untied embedding, output layer
    in_units = {id(p) for unit in [*blocks, *others] for p in unit.parameters()}
    root = sum(_nbytes(p) for p in model.parameters() if id(p) not in in_units)
    largest = max((sum(_nbytes(p) for p in block.parameters()) for block in blocks), default=0)
    in_flight = BLOCKS_IN_FLIGHT["cpu" if device.type == "cpu" else "accelerator"]
    # such a unit counted once: a Llama-shaped 106M GPT (the embedding and the output layer each 0.23x of it)
    # measured 0.97-1.10x above a tiny run, plan 1.23x so, 1.47x counting two of it as two blocks
    other = max((sum(_nbytes(p) for p in unit.parameters()) for unit in others), default=0)
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
    from distrib.plan.pipeline import no_pipeline, plan_pipeline  # (it builds on this module's helpers)

    sample, pipeline = first_samples(data.train, batches.micro_batch_size), None
    # MetaRouting: an MoE layer's meta passes; autocast_on_meta: peft's LoRA on its experts, on meta
    with fake_process_group(mesh.world_size), MetaRouting(), autocast_on_meta():
        if shape.pipeline > 1:  # every pipeline rank's stages: the fullest rank's state
            pipeline = plan_pipeline(config, strategy, data.info, machine, device, batches, sample)
            parts, local_params, held = pipeline["parts"], pipeline["local_parameters"], pipeline["experts"]
        else:
            parts, local_params, held = _sharded_state(config, strategy, data.info, mesh, device)
        model = meta_model(config, data.info)
        inputs, targets = shaped_batch(sample, batches.micro_batch_size)
        whole, recomputed, sent = rank_activations(config, strategy, data.info, mesh, device, inputs, targets)
    compute_bytes = 2 if config.train.precision == "bf16" else 4
    traffic = (shape, config.dist, machine.nproc_per_node, local_params, compute_bytes, config.train.grad_accum_steps,
               _tp_activations(model, shape, inputs, config) * compute_bytes,
               _root_share(model, config, shape.tensor_parallel),
               held["expert_parameter_bytes_per_rank"] // 4,  # (FSDP2 keeps fp32 parameters)
               sum(_nbytes(b) for b in model.buffers()),
               _context_bytes(config, shape, sent * compute_bytes))
    intra, inter = step_traffic(*traffic)
    experts = expert_plan(held, shape, machine.nproc_per_node, num_tokens(inputs),
                          compute_bytes, config.train.grad_accum_steps,
                          config.speed.activation_checkpointing == "blocks")
    intra += experts["all_to_all_bytes_per_step_intra_node"]
    inter += experts["all_to_all_bytes_per_step_inter_node"]
    state = sum(parts.values())
    activations = recomputed if config.speed.activation_checkpointing == "blocks" else whole
    peak = peak_terms(config, strategy, model, activations, local_params, device, parts["gradients"])
    step = planned_step(parts, activations, peak, config.train.grad_accum_steps)
    needed = step.peak
    staged = pipeline["figures"] if pipeline else no_pipeline(config, activations)
    if pipeline:  # the highest pipeline rank's peak; the activations sent between stages on top of the collectives
        peak, needed = {**pipeline["peak"], "ddp_bucket_bytes_per_rank": 0}, pipeline["memory_bytes_per_rank"]
    memory = _memory_figures(config, strategy, machine, data.info, parts, needed, device)
    fixing = (pipeline["steps"], staged["pipeline_microbatches"]) if pipeline else ([(step, recomputed)], 1)
    fixed = [] if memory["fits"] else _fixes(config, strategy, machine, model, *fixing, device)
    intra += staged["pipeline_bytes_per_step_intra_node"]
    inter += staged["pipeline_bytes_per_step_inter_node"]
    bound = max(intra / machine.intra_node_bandwidth, inter / machine.inter_node_bandwidth)
    goodput = plan_goodput(config, machine, shape.layout(), parts["parameters"] + parts["optimizer"], bound)
    return {"world_size": machine.world_size, "nnodes": machine.nnodes, "nproc_per_node": machine.nproc_per_node,
            "strategy": config.dist.strategy, "mesh": shape.layout(),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "parameter_bytes_per_rank": parts["parameters"], "gradient_bytes_per_rank": parts["gradients"],
            "optimizer_bytes_per_rank": parts["optimizer"], "state_bytes_per_rank": state,
            "activation_bytes_per_micro_batch": whole, "activation_bytes_per_micro_batch_checkpointed": recomputed,
            "global_batch_size": batches.global_batch_size, "micro_batch_size": batches.micro_batch_size,
            "grad_accum_steps": batches.grad_accum_steps, "data_parallel_size": shape.batch_ranks,
            "collective_bytes_per_step_intra_node": intra, "collective_bytes_per_step_inter_node": inter,
            "named_collectives": named_traffic(*traffic),
            "collectives": collectives(*traffic, experts=experts, staged=staged),
            "device_memory_bytes": machine.device_memory, "memory_bytes_per_rank": needed, **peak,
            "host_allocator": described_allocator(strategy, model) if device.type == "cpu" else "",
            **memory, **staged, **experts, "fixes": fixed,
            "step_seconds_lower_bound": bound, **goodput}


def _fixes(config: Config, strategy: Strategy, machine: Machine, model: nn.Module, steps: list[tuple],
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


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def table(figures: dict, machine: Machine) -> str:
    """The plan as the lines `distrib plan` prints."""
    f = figures
    mesh = " x ".join(f"{name} {size}" for name, size in f["mesh"].items())
    rows = [
        ("model", f"{f['num_parameters'] / 1e9:.3f} B parameters"),
        ("world", f"{f['nnodes']} node(s) x {f['nproc_per_node']} = {f['world_size']} ranks, {f['strategy']} "
                  f"({mesh})"),
        ("parameters / rank", _size(f["parameter_bytes_per_rank"])),
        ("gradients / rank", _size(f["gradient_bytes_per_rank"])),
        ("optimizer state / rank", _size(f["optimizer_bytes_per_rank"])),
        ("state_bytes_per_rank", f"{_size(f['state_bytes_per_rank'])} ({f['state_bytes_per_rank']} bytes)"),
        ("activations / micro-batch", f"{_size(f['activation_bytes_per_micro_batch'])}; with activation "
                                      f"checkpointing {_size(f['activation_bytes_per_micro_batch_checkpointed'])}"
                                      + (" (all stages; a pipeline rank's below)" if f["pipeline_parallel"] > 1
                                         else "")),
        *_pipeline_rows(f),
        *expert_rows(f, _size),
        ("batch", f"global {f['global_batch_size']} = {f['data_parallel_size']} data-parallel ranks x "
                  f"{f['grad_accum_steps']} grad-accum steps x micro-batch {f['micro_batch_size']}"),
        ("collectives / step", f"{_size(f['collective_bytes_per_step_intra_node'])} intra-node, "
                               f"{_size(f['collective_bytes_per_step_inter_node'])} inter-node per rank"),
        *(("", f"of which the {c['name']}: {_size(c['intra_node'])} intra-node, {_size(c['inter_node'])} "
               "inter-node") for c in f["named_collectives"]),
        *collective_rows(f, _size, machine.intra_node_bandwidth, machine.inter_node_bandwidth),
        ("start-up / rank", f"{_size(f['startup_bytes_per_rank'])} while building and loading ("
                            + ("each rank reads its shards from model.init_from" if f["loads_weights"] else
                               "the model initialises its own shards" if f["self_initialising"] else
                               "rank 0 also builds the whole model in host memory") + ")"),
        ("gathered in flight", f"{_size(f['gathered_bytes_per_rank'])} " + (
            "(the root unit, and the largest block's bytes at its backward)" if f["pipeline_parallel"] == 1 else
            f"(its stages' parameters, from their first backward to the step's end), their gradients unsharded "
            f"{_size(f['unsharded_gradient_bytes_per_rank'])}, receive buffers "
            f"{_size(f['pipeline_buffer_bytes_per_rank'])}")),
        ("optimizer temporaries", _size(f["optimizer_temporary_bytes_per_rank"])),
        *([("DDP gradient buckets", f"{_size(f['ddp_bucket_bytes_per_rank'])} (a copy of the gradients; "
                                    "speed.gradient_as_bucket_view = true shares them)")]
          if f["ddp_bucket_bytes_per_rank"] else []),
        ("allocator slack", f"{_size(f['allocator_slack_bytes_per_rank'])}"
                            + (f" ({f['host_allocator']} on the host)" if f["host_allocator"] else "")),
        ("device memory", f"{'fits' if f['fits'] else 'DOES NOT FIT'}: {_size(f['memory_bytes_per_rank'])} of "
                          f"{_size(f['device_memory_bytes'])} (the step's peak: parameters, optimizer, gathered, "
                          "the larger of activations and gradients, slack)"),
        *_fix_rows(f),
        ("end-of-run save", f"rank 0 holds {_size(f['save_bytes_rank0'])} more than the others" + (
            " (model.pt gathered whole, one file of at most model.max_shard_size)" if f["save_bytes_rank0"] else
            " (every rank writes its own blocks of weights/)")),
        ("host memory / node", f"{'fits' if f['fits_host'] else 'DOES NOT FIT'}: "
                               f"{_size(f['startup_host_bytes_per_node'])} at start-up, "
                               f"{_size(f['host_bytes_per_node'])} in steady state, "
                               f"{_size(f['save_host_bytes_per_node'])} at the end-of-run save, of "
                               f"{_size(f['host_memory_bytes'])}"),
        ("step time >=", f"{f['step_seconds_lower_bound'] * 1e3:.1f} ms from communication at "
                         f"{machine.intra_node_bandwidth / GB:g} GB/s intra-node, "
                         f"{machine.inter_node_bandwidth / GB:g} GB/s inter-node"),
        *(goodput_rows(f) if "goodput_at_optimum" in f else []),
    ]
    return "\n".join(f"{name:<26} {value}" for name, value in rows)


def _fix_rows(f: dict) -> list[tuple[str, str]]:
    """Under DOES NOT FIT: each fix with the peak it gives (distrib.plan.fixes), those that fit first."""
    if f["fits"]:
        return []
    ordered = sorted(f["fixes"], key=lambda fix: not fix["fits"])
    if not ordered:
        return [("fixes", "none that plan knows lowers the peak: a device with more memory (--device-memory)")]
    return [("fixes" if i == 0 else "", f"{fix['fix']}: {_size(fix['memory_bytes_per_rank'])}, "
                                        f"{'fits' if fix['fits'] else 'does not fit'}")
            for i, fix in enumerate(ordered)]


def _pipeline_rows(f: dict) -> list[tuple[str, str]]:
    """Under pipeline parallel: the schedule and its bubble, each pipeline rank's stages, what each holds, and the
    activations sent between stages."""
    if f["pipeline_parallel"] == 1:
        return []
    rows = [("pipeline", f"{f['pipeline_parallel']} ranks x {f['pipeline_stages_per_rank']} stage(s), "
                         f"{f['pipeline_schedule']}, {f['pipeline_microbatches']} microbatches per micro-batch: "
                         f"bubble {f['bubble_share']:.1%} of a step")]
    for rank in f["stages"]:
        held = ", ".join(f"{s['stage']} ({s['units'][0]}" + (f" .. {s['units'][-1]})" if len(s["units"]) > 1 else ")")
                         for s in rank["stages"])
        in_flight = "+".join(str(s["microbatches_in_flight"]) for s in rank["stages"])
        rows.append((f"pipeline rank {rank['pipeline_rank']}",
                     f"stage {held}: state {_size(rank['state_bytes'])}, {in_flight} microbatch(es) in flight "
                     f"{_size(rank['activation_bytes_in_flight'])}, peak {_size(rank['memory_bytes'])}"))
    rows.append(("between stages / step", f"{_size(f['pipeline_bytes_per_step_intra_node'])} intra-node, "
                                          f"{_size(f['pipeline_bytes_per_step_inter_node'])} inter-node per rank "
                                          "(activations on, gradients back; in the collectives' figures)"))
    return rows


def main(config: Config, machine: Machine, as_json: bool) -> int:
    figures = plan_run(config, machine)
    print(json.dumps(figures, indent=1) if as_json else table(figures, machine))
    return 0
