"""The dry run's fake world (distrib.plan.dry_run): a rank's model laid out by the run's own calls with its tensors
fake, its optimizer's state created, torch's memory tracker over it, and the trainer's step run on fake micro-batches
(a pipeline's stages: distrib.plan.fake_pipeline)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from distrib.config import Config
from distrib.data.batching import BatchPlan
from distrib.distributed.parallelize import prepare
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import Strategy
from distrib.distributed.strategies.base import StepLoss
from distrib.distributed.strategies.materialise import build_on_meta
from distrib.models.build import build_model
from distrib.plan import blocks as cut_blocks
from distrib.plan.batch import shaped_batch
from distrib.training.evaluation import autocast
from distrib.training.losses import build_loss, forward, step_loss

HOST = torch.device("cpu")


class FrozenParameterHooks(TorchFunctionMode):
    """MemTracker (the dry run's tracker under ddp) registers gradient hooks on each parameter of a module at its
    forward, which a frozen one (a LoRA model's base weights) refuses: "cannot register a hook on a tensor that doesn't
    require gradient". Those are left out (a handle that removes nothing): no gradient of theirs ever comes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook) \
                and isinstance(args[0], nn.Parameter) and not args[0].requires_grad:
            return RemovableHandle(OrderedDict())
        return func(*args, **(kwargs or {}))


def laid_out(config: Config, strategy: Strategy, info, runtime: Runtime, fake, blocks: int | None = None
             ) -> nn.Module:
    """The model as runtime.rank holds it, by the run's own calls (as strategy.setup_module lays it out, compile
    left out: it changes no tensor's size), its tensors fake (made under `fake`): sharded on meta then materialised,
    or materialised whole (ddp). The mesh is built outside the fake mode (it reads real tensors): plan_module's. Cut
    to its first `blocks` blocks where given."""
    speed = dataclasses.replace(config.speed, compile=False)
    model = build_on_meta(lambda: cut_to(build_model(config.model, info), config, blocks), config.train.seed)
    if strategy.dims.fully_shard:
        model = strategy.plan_module(model, runtime, config.train.precision, speed)
    else:  # parallelize's steps before DDP's wrapper (ddp takes no tensor parallel), which cannot wrap fake tensors:
        prepare(model, speed, config.dist.shard_modules)  # its buckets are counted (ddp_buckets)
    with fake:
        return model.to_empty(device=HOST)


def cut_to(model: nn.Module, config: Config, blocks: int | None) -> nn.Module:
    return model if blocks is None else cut_blocks.cut(model, config, blocks)


def create_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state (momenta, moments), as a first step leaves it; no gradients left. Stepped as the trainer
    steps (foreach, in chunks): a state created tensor by tensor made the measured step's temporaries 2x as large."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param) if param.requires_grad else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def memory_tracker(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer):
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


def step_loss_of(config: Config, strategy: Strategy, targets: list) -> StepLoss:
    """The trainer's StepLoss (distrib.training.trainer): the config's loss, normalised once for the step."""
    shares = strategy.runner.loss_shares(strategy.dims.world_size)
    return StepLoss(loss=step_loss(build_loss(config.train), targets, shares), forward=forward,
                    autocast=lambda: autocast(config.train.precision, HOST), backward=lambda loss: loss.backward(),
                    batch=lambda inputs, targets: {}, device=HOST)


def run_step(config: Config, strategy: Strategy, model: nn.Module, sample, batches: BatchPlan) -> None:
    """The trainer's forward and backward of a step's micro-batches (strategy.forward_backward), of fake tensors
    (made on the host under the fake mode) shaped as the data's."""
    micro_batches = [shaped_batch(sample, batches.micro_batch_size, HOST) for _ in range(batches.grad_accum_steps)]
    strategy.forward_backward(model, micro_batches, step_loss_of(config, strategy, [t for _, t in micro_batches]))


def optimizer_step(config: Config, strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if config.train.grad_clip:
        strategy.clip_grad_norm(model, config.train.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def ddp_buckets(config: Config, strategy: Strategy, model: nn.Module) -> int:
    """DDP's gradient buckets, which its reducer allocates at wrapping and keeps (a copy of the gradients, unless
    speed.gradient_as_bucket_view makes the gradients views of them): counted, not measured."""
    if strategy.dims.fully_shard or config.speed.gradient_as_bucket_view:
        return 0
    return sum(p.nbytes for p in model.parameters() if p.requires_grad)
