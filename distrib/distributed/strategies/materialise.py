"""Building a model without any rank holding it whole: on the meta device, then only each rank's shards materialised
on its device, with bitwise the starting weights of a one-process run of the same seed.

Two ways to those weights. A model with its own initialisation of every parameter and buffer (init_weights() or
reset_parameters(), as the built-in GPT) initialises its shards: each random fill runs on the whole tensor on the host,
one tensor at a time (the CPU generator draws exactly what one process draws), and the rank keeps its slice. Any other
model is built whole once per job, in rank 0's host memory, and each rank is sent its shards. A model whose weights
are loaded (model.init_from) needs neither: its parameters are made on meta, and only its buffers as usual."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from distrib.distributed.parallel import misplaced_tensors, place_model
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError
from distrib.torch_private import storage_id

_INIT_METHODS = ("init_weights", "reset_parameters")
# The in-place fills that draw from the generator: made whole, then sliced. Every other op (fill_, mul_, copy_ from a
# plain tensor...) is elementwise, and DTensor runs it on the local shard with the same result.
_RANDOM_FILLS = frozenset({"normal_", "uniform_", "bernoulli_", "exponential_", "random_", "cauchy_", "log_normal_",
                           "geometric_"})


def init_method(model: nn.Module) -> Callable[[], None] | None:
    """The model's own initialisation: init_weights() (torchtitan's name) or reset_parameters() (torch's); not the
    init_weights that transformers' PreTrainedModel inherits, which would wipe weights a factory loaded."""
    for name in _INIT_METHODS:
        method = getattr(type(model), name, None)
        if callable(method) and not (getattr(method, "__module__", "") or "").startswith("transformers"):
            return getattr(model, name)
    return None


def build_whole(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """The whole model on the host, as every strategy's reference: seed, factory; then for a model with its own
    initialisation, seed again and call it, so that initialising shard by shard gives the same bits at any world
    size (the constructor's own draws are discarded)."""
    torch.manual_seed(seed)
    model = factory()
    init = init_method(model) if isinstance(model, nn.Module) else None
    if init is not None:
        torch.manual_seed(seed)
        init()
    return model


def build_on_meta(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """The model with every tensor on the meta device: shapes and structure, no memory, no random draws."""
    torch.manual_seed(seed)
    try:
        with torch.device("meta"):
            return factory()
    except UserError as e:
        if not _loads_weights_itself(e):
            raise
        factory_key = str(e).split(": calling it with")[0]
        raise UserError(f"{factory_key}: calls from_pretrained, which reads every weight on every rank, and a sharded "
                        "strategy builds the model on the meta device so that no rank holds it whole; build the model "
                        "from its config in the factory (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("
                        "FOLDER)), then get_peft_model for an adapter) and --set model.init_from=FOLDER: each rank "
                        "reads only its shards (or --set dist.strategy=ddp)") from None


def _loads_weights_itself(error: BaseException | None) -> bool:
    """Whether transformers refused a from_pretrained under the meta device (somewhere in the error's chain)."""
    while error is not None:
        if "from_pretrained" in str(error) and "meta" in str(error):
            return True
        error = error.__cause__
    return False


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers moves to the meta device at once (a tied one, already there, stays the
    same object); buffers and everything else are made as usual (Accelerate's init_empty_weights, buffers kept)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_for_loading(factory: Callable[[], nn.Module], seed: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model whose weights will be loaded: its parameters on the meta device (no memory; the constructor's
    initialisation of them does nothing), its buffers as the constructor computes them; and a copy of the
    non-persistent ones (a rotary embedding's inv_freq), which no weights file holds and to_empty wipes."""
    torch.manual_seed(seed)
    with _parameters_on_meta():
        model = factory()
    persistent = set(model.state_dict())
    kept = {name: buffer.clone() for name, buffer in model.named_buffers() if name not in persistent}
    unknown = [name for name, buffer in kept.items() if buffer.is_meta]
    if unknown:
        raise UserError(f"model.init_from: the model's non-persistent buffer {unknown[0]} is computed from its "
                        "parameters in its constructor, where they have no values yet (a sharded strategy makes them "
                        "on the meta device and reads them from the weights); compute it in forward, or register it "
                        "as persistent so that it is read from the weights too")
    return model, kept


def restore_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """The non-persistent buffers build_for_loading kept, into the materialised model."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:
                buffer.copy_(buffers[name])


def _storage(tensor: torch.Tensor) -> int:
    return storage_id(tensor)


def _in_place_target(func, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor an in-place op (a method like normal_ or copy_, or a torch.nn.init function) writes, else None."""
    name = getattr(func, "__name__", "")
    if not name.endswith("_") or name.startswith("_"):
        return None
    target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword to torch functions
    return target if isinstance(target, torch.Tensor) else None


def _is_init_function(func) -> bool:
    return getattr(func, "__module__", "") == "torch.nn.init"


class _Writes(TorchFunctionMode):
    """Records the storage of every tensor an in-place op writes."""

    def __init__(self):
        super().__init__()
        self.written: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _in_place_target(func, args, kwargs)
        if target is not None:
            self.written.add(_storage(target))
        return func(*args, **kwargs)


def initialises_itself(model: nn.Module) -> bool:
    """Whether the model's own initialisation writes every parameter and buffer: tried on the meta-device model,
    which costs nothing and draws nothing."""
    init = init_method(model)
    if init is None:
        return False
    with torch.no_grad(), _Writes() as writes:
        init()
    return all(_storage(t) in writes.written for t in [*model.parameters(), *model.buffers()])


class _WholeThenSlice(TorchFunctionMode):
    """A torch.nn.init function or a random fill applied to a DTensor runs on the whole tensor on the host instead
    (the CPU generator draws what one process draws for it, and fans are the whole tensor's), and this rank keeps its
    slice: one tensor whole at a time, never the model. Other in-place ops are elementwise: DTensor runs them on the
    local shard, with the same result. A fill of a meta tensor (a pipeline stage another rank holds) is drawn and
    dropped, so that the draws for this rank's tensors are the ones one process makes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = _in_place_target(func, args, kwargs)
        whole_op = _is_init_function(func) or getattr(func, "__name__", "") in _RANDOM_FILLS
        if not whole_op or not (isinstance(target, DTensor) or (target is not None and target.is_meta)):
            return func(*args, **kwargs)
        from distrib.torch_private import compute_local_shape_and_global_offset

        whole = torch.empty(target.shape, dtype=target.dtype)
        if args:
            func(whole, *args[1:], **kwargs)
        else:
            func(**{**kwargs, "tensor": whole})
        if not isinstance(target, DTensor):  # another pipeline stage's: drawn as one process draws it, then dropped
            return target
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        target.to_local().copy_(whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))])
        return target


def init_shards(model: nn.Module, seed: int) -> None:
    """The model's own initialisation on its materialised shards, bitwise what build_whole gives the whole."""
    init_seeded(init_method(model), seed)


def init_seeded(init: Callable[[], object], seed: int) -> None:
    """An initialisation (of the whole model or a part) after seeding, on plain tensors or on shards alike: each
    random fill of a DTensor is drawn whole, as one process draws it, and each rank keeps its slice."""
    torch.manual_seed(seed)
    with torch.no_grad(), _WholeThenSlice():
        init()


def load_from_rank0(model: nn.Module, factory: Callable[[], nn.Module], seed: int, runtime: Runtime,
                    log: Callable[[str], None], part: bool = False) -> None:
    """Rank 0 builds the whole model once, in host memory, and sends each rank its shards (set_model_state_dict's
    broadcast_from_rank0: every rank receives each tensor in turn and keeps its slices of those it holds); the
    non-persistent buffers follow whole. part: the model is a part of the whole (a pipeline rank's stages), which
    keeps only its own tensors. A collective; a factory that fails on rank 0 stops every rank with a line that says
    so."""
    whole, failed = None, [False]
    if runtime.is_main:
        try:
            whole = place_model(build_whole(factory, seed), torch.device("cpu"))  # also lists meta tensors
        except BaseException:
            failed = [True]
            dist.broadcast_object_list(failed, src=0)
            raise
    dist.broadcast_object_list(failed, src=0)
    if failed[0]:
        raise UserError("rank 0 could not build the model (its error says why); this rank stopped too")
    if whole is not None:
        size = sum(t.numel() * t.element_size() for t in whole.state_dict().values())
        log(f"the model cannot initialise its own shards (no init_weights() or reset_parameters() that writes every "
            f"parameter and buffer): rank 0 built it whole once in host memory ({size / 2**20:.1f} MiB) and sent "
            "each rank its shards")
    set_model_state_dict(model, whole.state_dict() if whole is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not part))
    _broadcast_plain_buffers(model, whole, runtime.device)


def _broadcast_plain_buffers(model: nn.Module, whole: nn.Module | None, device: torch.device) -> None:
    """The whole model's non-persistent buffers, rank 0's, each broadcast in rank 0's order; a rank that holds one
    (under pipeline parallel, not every rank holds every buffer) keeps it."""
    said = [None]
    if whole is not None:
        persistent = set(whole.state_dict())
        said = [[(name, buffer) for name, buffer in whole.named_buffers() if name not in persistent]]
        said = [[(name, tuple(buffer.shape), buffer.dtype) for name, buffer in said[0]]]
    dist.broadcast_object_list(said, src=0)
    mine, sources = dict(model.named_buffers()), dict(whole.named_buffers()) if whole is not None else {}
    for name, shape, dtype in said[0]:
        target = mine[name] if name in mine else torch.empty(shape, dtype=dtype, device=device)
        if name in sources:
            target.copy_(sources[name])
        dist.broadcast(target, src=0)


def check_materialised(model: nn.Module, device: torch.device) -> list[str]:
    """Every parameter and buffer not on `device` after materialisation (of a model that was never whole: its local
    shards and buffers), in the words of the device-mismatch listing."""
    return misplaced_tensors(model, device)
