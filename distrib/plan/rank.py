"""A rank as the plan sees it, on the meta device: the model built (whole, or laid out by the run's own calls over the
fake group), its optimizer's state after one step on meta, the bytes of its state, and its activations' bytes."""

from __future__ import annotations

import torch
import torch.nn as nn

from distrib.config import Config
from distrib.distributed import dimensions, fsdp
from distrib.distributed.parallel import local_tensor, state_parts
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import Strategy
from distrib.distributed.strategies.materialise import initialises_itself
from distrib.models.build import build_model
from distrib.plan.activations import rank_batch, split_as_run, target_attention
from distrib.plan.experts import held_experts
from distrib.plan.machine import Machine
from distrib.plan.saved import activation_bytes, tensor_bytes
from distrib.training.losses import build_loss
from distrib.training.optimizers import build_optimizer


def meta_model(config: Config, info) -> nn.Module:
    torch.manual_seed(config.train.seed)
    with torch.device("meta"):
        model = build_model(config.model, info)
    return model.to(torch.bfloat16) if config.train.precision == "bf16" else model


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


def sharded_state(config: Config, strategy: Strategy, info, machine: Machine, device: torch.device
                   ) -> tuple[dict, int, dict]:
    """Rank 0's bytes of parameters, gradients and optimizer state (the fullest rank: shards are chunks, rank 0's
    the largest), the parameters it holds, and its part of the experts (distrib.plan.experts.held_experts)."""
    model, optimizer = planned_rank(config, strategy, info, machine, device, 0)
    return (state_parts_planned(model, optimizer, strategy, device), local_parameters(model),
            held_experts(model, optimizer))


def whole_model(config: Config, info) -> tuple[int, int, bool]:
    """Bytes of the whole model's parameters and buffers (tied ones once), of its largest tensor, and whether it
    initialises itself (then no rank ever builds it whole under sharded strategies)."""
    torch.manual_seed(config.train.seed)
    with torch.device("meta"):
        model = build_model(config.model, info)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(map(tensor_bytes, tensors)), max(map(tensor_bytes, tensors)), initialises_itself(model)


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
