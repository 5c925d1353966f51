"""FSDP2's mechanics for the sharded strategies (distrib.distributed.strategies.fsdp): fully_shard on each block, on
each large module outside them (leftover_units), then the root, its mixed-precision and offload policies, and the
state dicts of a sharded model (sharded for checkpoints, gathered on rank 0 for model.pt).

Blocks (dist.shard_modules) are also what speed.activation_checkpointing recomputes, under either strategy."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from distrib.config import DistConfig
from distrib.distributed.runtime import Runtime
from distrib.distributed.unused import experts_lists, inside_experts
from distrib.errors import ConfigError
from distrib.torch_private import BatchNormBase

# auto: a child (looking inside ModuleList / ModuleDict / Sequential containers) holding at least this share of the
# model's parameters is a block; so the layers of a model up to 64 layers deep each become one.
AUTO_MIN_SHARE = 1 / 64
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _auto_blocks(module: nn.Module, threshold: int, experts: set[int]) -> list[nn.Module]:
    found = []
    for child in module.children():
        if any(id(member) in experts for member in child.children()):
            continue  # an experts list: its members stay in their parent's unit
        if isinstance(child, _CONTAINERS):
            found += _auto_blocks(child, threshold, experts)
        elif _num_params(child) >= threshold:
            found.append(child)
    return found


def _named_blocks(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    return [m for m in reversed(list(model.modules())) if m is not model and type(m).__name__ in names]


def find_blocks(model: nn.Module, spec: str | tuple[str, ...]) -> list[nn.Module]:
    """The modules dist.shard_modules names, innermost first (fully_shard goes bottom-up); never the root, nor a
    module inside an experts list (distrib.distributed.unused: a unit whose forward never runs on a rank fires no
    post-backward there, and the ranks' reductions no longer pair up). auto: the classes a model lists in
    `_no_split_modules` (the Hugging Face convention; distrib's GPT lists its Block), else the children holding a
    large share of the parameters."""
    experts = inside_experts(model)
    if spec == "auto":
        declared = tuple(getattr(model, "_no_split_modules", None) or ())
        named = [block for block in _named_blocks(model, declared) if id(block) not in experts]
        return named or _auto_blocks(model, max(1, int(_num_params(model) * AUTO_MIN_SHARE)), experts)
    found = _named_blocks(model, (spec,) if isinstance(spec, str) else spec)
    if not found:
        classes = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ConfigError(f"dist.shard_modules = {spec!r}: no module of the model has that class; "
                          f"its classes are {', '.join(classes)}; name some of them or use auto")
    expert = next((block for block in found if id(block) in experts), None)
    if expert is not None:
        raise ConfigError(f"dist.shard_modules = {spec!r}: {type(expert).__name__} modules sit in the model's experts "
                          f"lists ({', '.join(experts_lists(model))}), which run only on the tokens routed to them, "
                          "so one as a unit of its own would leave the ranks' gradient reductions unpaired; name the "
                          "class that holds the experts (a decoder layer) or use auto")
    return found


def leftover_units(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Modules outside every block whose own parameters hold at least AUTO_MIN_SHARE of the model and are theirs alone
    (a Llama's embedding and output layer; not a table tied to another module, nor a module around blocks): FSDP units
    of their own, as torchtitan makes them. In the root's unit they would stay gathered from the root's forward to its
    backward, every step: most of the 0.5x of the model that a 104M Llama held per rank at world size 4."""
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    experts = inside_experts(model)
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    threshold = max(1, int(_num_params(model) * AUTO_MIN_SHARE))
    found = []
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if module is model or id(module) in in_blocks or any(id(m) in in_blocks for m in module.modules()) \
                or id(module) in experts:  # an expert stays in its parent's unit (see find_blocks)
            continue
        if own and sum(p.numel() for p in own) >= threshold and all(owners[id(p)] == 1 for p in own):
            found.append(module)
    return found


def _checkpointed(forward, *args, **kwargs):
    # Non-reentrant: works with FSDP's hooks and with inputs that do not require grad.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(model: nn.Module, spec: str | tuple[str, ...]) -> int:
    """Each block keeps only its inputs in forward and recomputes the rest in backward; the module tree and the
    state_dict keys stay as they were (the forward is wrapped in place). Returns the number of blocks."""
    blocks = find_blocks(model, spec)
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    return len(blocks)


def shard(model: nn.Module, runtime: Runtime, config: DistConfig, precision: str, mesh: DeviceMesh,
          roots: list[nn.Module] | None = None,
          experts: tuple[list[nn.Module], DeviceMesh, int] | None = None) -> FSDPModule:
    """fully_shard on each block, then on the root (which takes the rest), over the data-parallel mesh: one dimension
    shards, two replicate over the first and shard over the second. On a model on
    the meta device (as the strategy builds it) nothing is allocated: the shards are materialised afterwards. roots:
    the modules that run in place of the model (pipeline stages, views of it), each a root of its own that takes
    all but the blocks and stays gathered from its forward to its backward (FSDP2's default for a root). experts: the
    experts modules expert parallel split, each a unit of its own over their mesh (what remains of the data-parallel
    ranks), and the data-parallel size their gradients are averaged over (torchtitan's).

    Under bf16, each BatchNorm is a unit of its own that computes in fp32 (its parameters and inputs; autocast casts
    its output back for the next layer): its running statistics are fp32 buffers, which FSDP does not cast, and
    batch_norm refuses bf16 weights beside them ("expected scalar type BFloat16 but found Float")."""
    mixed = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16"
             else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy(pin_memory=runtime.pin_memory) if config.cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=mixed,
                   offload_policy=offload)
    norms = [m for m in model.modules() if isinstance(m, BatchNormBase) and m is not model] \
        if precision == "bf16" else []
    for norm in norms:
        fully_shard(norm, **{**options, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.float32,
                                                                          reduce_dtype=torch.float32)})
    for unit in experts[0] if experts else ():
        _shard_experts(unit, {**options, "mesh": experts[1]}, experts[2])
    blocks = find_blocks(model, config.shard_modules)
    # Pipeline stages hold all their units gathered from their first backward to the step's end (torch's schedules
    # reshard and reduce after the last microbatch), so there an embedding or head of its own, a root resharded after
    # each forward, or a backward without prefetch lowers no peak: each only adds gathers, every microbatch (pp 2 x
    # fsdp 2 Llama: 12 all-gathers and 4 reduce-scatters a step on the last stage for the hand loop's 7 and 3).
    staged = roots is not None
    for unit in blocks if staged else [*blocks, *leftover_units(model, blocks)]:
        if not any(unit is norm for norm in norms):  # a norm large enough to be a block is sharded already
            fully_shard(unit, **options)
            if mesh.device_type == "cpu" and not staged:
                # FSDP2 gathers the next block's parameters while a block's backward runs, to overlap the two on an
                # accelerator's streams; in host memory that is one more block resident at the backward's peak
                # (0.12x of an 8-block GPT's bytes per rank, measured), so each block prefetches only itself: none.
                unit.set_modules_to_backward_prefetch([unit])
    roots = roots or [model]  # the model's own root takes the rest; pipeline stages are roots of their own
    for root in roots:
        # a stage root stays gathered from its forward to its backward (FSDP2's own default for a root)
        fully_shard(root, **{**options, "reshard_after_forward": False} if staged else options)
    # A parameter without a gradient on some ranks (an expert no token reached there) joins its unit's reduce-scatter
    # as zeros, so that every rank's reduction has the same size (without it the sizes differ and the backend aborts).
    for root in roots:
        root.set_reduce_scatter_unused_params(True)  # recursing into its units
    return model


def _shard_experts(unit: nn.Module, options: dict, data_parallel: int) -> None:
    """One experts module's unit. Its gradients are summed over fewer ranks than the dense ones (the ep ranks'
    tokens already met in its all-to-all's backward): divided by every data-parallel rank (times those that share a
    sample's tokens, ParallelDims.token_split, each of which added its part) all the same, so that they are the whole
    batch's mean as in one process."""
    fully_shard(unit, **options)
    unit.set_gradient_divide_factor(data_parallel)
    if options["mesh"].device_type == "cpu":
        unit.set_modules_to_backward_prefetch([unit])  # no prefetch in host memory, as for the blocks
        # The CPU's backend has no pre-multiplied sum: a sum, then the division. Not over one rank (ep = the whole
        # shard group), where torch 2.14 would divide twice (once in place of the reduce-scatter, once after it).
        if options["mesh"].shape[-1] > 1:
            unit.set_force_sum_reduction_for_comms(True)


# The optimizer state flattened (state.NAME.exp_avg, param_groups.NAME.lr): every parameter carries its group's
# settings by name, so a rank that holds some of the parameters (a pipeline stage) saves and finds its own; nested,
# DCP keeps one rank's param_groups, which name only its stage's parameters (torchtitan flattens for the same reason).
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Model and optimizer state keyed by parameter names (no prefixes), as DTensors holding this rank's shards of a
    sharded model, or plain tensors of a plain one: what torch.distributed.checkpoint saves and reshards on load."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=_FLAT)
    return {"model": model_state, "optimizer": optimizer_state}


def reshard(model: nn.Module) -> None:
    """Every FSDP module of the model back on its shards (a no-op for those that are), with no gradient (the
    zeros FSDP2 leaves for unused parameters after a counting backward) for its first step to find."""
    _no_gradients(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def keyed_by_name(optimizer_state: dict) -> bool:
    """Whether an optimizer state_dict is keyed by parameter names (a sharded checkpoint's, flattened) or by
    integer ids (torch's own, what a one-file checkpoint holds)."""
    return "param_groups" not in optimizer_state


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    _no_gradients(model)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_FLAT)
    _check_loaded(optimizer, any(key.startswith("state.") for key in state["optimizer"]))


def _no_gradients(model: nn.Module) -> None:
    """Gradients cleared before an optimizer state is loaded: torch's set_state_dict takes a gradient as the sign
    of an optimizer already stepped and then loads no state at all, silently (a backward before the first step
    leaves zeros: FSDP2 reduce-scatters unused parameters' gradients, even for torch.autograd.grad)."""
    model.zero_grad(set_to_none=True)


def _check_loaded(optimizer: torch.optim.Optimizer, saved: bool) -> None:
    if saved and not optimizer.state:
        raise RuntimeError("the checkpoint's optimizer state was not loaded into the optimizer")


def by_name(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
    """An optimizer state_dict keyed by integer ids (torch's own, what a one-file checkpoint holds) keyed by
    parameter names instead, as set_state_dict takes it: the ids count the parameters group by group, in order."""
    names = {id(param): name for name, param in model.named_parameters()}
    ordered = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    ids = [index for group in saved["param_groups"] for index in group["params"]]
    if len(ids) != len(ordered):
        raise ValueError(f"the checkpoint's optimizer has {len(ids)} parameters, this model {len(ordered)}")
    name_of = dict(zip(ids, ordered))
    return {"state": {name_of[index]: value for index, value in saved["state"].items()},
            "param_groups": [{**group, "params": [name_of[index] for index in group["params"]]}
                             for group in saved["param_groups"]]}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Whole tensors on every rank (a one-file checkpoint) into a sharded model: each rank keeps its own slices."""
    _no_gradients(model)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=by_name(model, optimizer, state["optimizer"]),
                   options=StateDictOptions(full_state_dict=True))


def full_model_state(model: nn.Module) -> dict:
    """The whole model's plain state_dict, gathered shard by shard into host memory on rank 0 ({} on the others).
    A collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
