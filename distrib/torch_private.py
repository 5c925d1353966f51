"""What torch and torchft keep private and distrib uses, in one place: each name beside the public API it waits for
("none yet": torch has none), so that a torch release that moves one breaks here and in its test, nowhere else.

Nothing is imported at import: each name loads on first use (PEP 562), so a module reading one of them pays for
torch._dynamo or torch.testing only when it runs, and `distrib lighthouse` (lighthouse_server_class) imports no
torch. tests/unit/test_torch_private.py loads every name, and fails naming the one torch moved.
nn.Module's own dicts (`_parameters`, `_buffers`, `_modules`) and torch.compile's `_orig_mod` are used in place:
torch's own parametrize, torchtitan and transformers write them, and `_orig_mod` is in every compiled state dict key.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_CHECKPOINT_PROCESS = "torch.distributed.checkpoint._async_process_executor"

# name here -> (torch's module, its name there), each with the public API it waits for
PRIVATE: dict[str, tuple[str, str]] = {
    # none yet: fake tensors are public only inside torch.export and torch.compile
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "is_fake": ("torch._subclasses.fake_tensor", "is_fake"),  # none yet (as FakeTensorMode)
    # torch.distributed.nn.functional.all_to_all_single is public, but neither traceable by torch.compile nor async
    "all_to_all_single": ("torch.distributed._functional_collectives", "all_to_all_single"),
    "all_to_all_single_autograd": ("torch.distributed._functional_collectives", "all_to_all_single_autograd"),
    # none yet: torch.distributed.nn.functional.all_gather is public but deprecated, and its backward gave context
    # parallel's key and value gradients 13-21 off on gloo (measured)
    "all_gather_single_autograd": ("torch.distributed._functional_collectives", "all_gather_single_autograd"),
    # none yet: a DTensor's local block in global coordinates (DTensor.__create_chunk_list__ gives it for DCP only)
    "compute_local_shape_and_global_offset": ("torch.distributed.tensor._utils",
                                              "compute_local_shape_and_global_offset"),
    "MemTracker": ("torch.distributed._tools.mem_tracker", "MemTracker"),  # none yet (torch.distributed._tools)
    "FSDPMemTracker": ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"),  # none yet
    "TorchDynamoException": ("torch._dynamo.exc", "TorchDynamoException"),  # none yet: torch.compile's errors' base
    # none yet: dcp.async_save(async_checkpointer_type=PROCESS) starts its process itself, on the first save, from a
    # pool thread (checkpoint/process.py says why distrib starts it)
    "AsyncCheckpointProcess": (_CHECKPOINT_PROCESS, "_AsyncCheckpointProcess"),
    "ProcessGroupInitInfo": (_CHECKPOINT_PROCESS, "_ProcessGroupInitInfo"),  # none yet (as AsyncCheckpointProcess)
    "CheckpointSaveProcessControlOpts": (_CHECKPOINT_PROCESS, "_CheckpointSaveProcessControlOpts"),  # none yet
    # none yet: the bases of every batch norm, instance norm and dropout (user subclasses included)
    "BatchNormBase": ("torch.nn.modules.batchnorm", "_BatchNorm"),
    "InstanceNormBase": ("torch.nn.modules.instancenorm", "_InstanceNorm"),
    "DropoutBase": ("torch.nn.modules.dropout", "_DropoutNd"),
    # the op a TorchFunctionMode sees under torch.nn.functional.grouped_mm (public in torch 2.14, which calls it)
    "grouped_mm": ("torch", "_grouped_mm"),
    "foreach_lerp_": ("torch", "_foreach_lerp_"),  # none yet: torch.optim's fused per-dtype kernels are private
    # none yet: GradScaler's fused non-finite check (torch.amp uses it, unexported)
    "amp_foreach_non_finite_check_and_unscale_": ("torch", "_amp_foreach_non_finite_check_and_unscale_"),
    "current_graph_task_id": ("torch._C", "_current_graph_task_id"),  # none yet: -1 outside a backward
    # none yet: the flight recorder's dump (torch.distributed's TORCH_NCCL_DEBUG_INFO_* dump it to files only)
    "dump_fr_trace": ("torch._C._distributed_c10d", "_dump_fr_trace"),
}

# DTensor's logger of redistribution warnings (quieted by tensor_parallel and expert_parallel): none yet
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
# What CheckpointProcess takes of its base (a subclass cannot do without): none yet, as AsyncCheckpointProcess
CHECKPOINT_PROCESS_MEMBERS = ("_checkpointing_subprocess", "_send", "_wait_for_response", "_process_pipe",
                              "_save_process")


def __getattr__(name: str):
    if name not in PRIVATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = PRIVATE[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PRIVATE))


def flatten_mesh(mesh, name: str):
    """mesh's dimensions as one, named `name` (kept by the root mesh). Waits for: none yet (DeviceMesh._flatten)."""
    return mesh._flatten(name)


def concatenate_meshes(meshes: list):
    """Submeshes of one root joined, as FSDP2 joins its own. Waits for: none yet (DeviceMesh._concatenate)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def forget_dtensor_plans() -> None:
    """Empties DTensor's caches of sharding and redistribution plans. Waits for: none yet (torch.distributed.tensor
    .debug exports only the sharding one, under a private name)."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def storage_id(tensor) -> int:
    """Which storage a tensor views, fake and meta ones included (whose data_ptr() is 0). Waits for: none yet."""
    return tensor.untyped_storage()._cdata


def view_base(tensor):
    """The tensor a view was made of (None: not a view). Waits for: none yet (Tensor._base)."""
    return tensor._base


def compiled_in_place(module) -> bool:
    """Whether nn.Module.compile() compiled this module. Waits for: none yet (Module._compiled_call_impl)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def register_fake_backend() -> None:
    """Registers torch's "fake" process-group backend (collectives that return at once), which importing this testing
    module does; its store can be the public dist.HashStore. Waits for: none yet (a public "fake" backend)."""
    importlib.import_module("torch.testing._internal.distributed.fake_pg")


def checkpoint_process():
    """The process dcp.async_save(..., PROCESS) writes through (None before its first). Waits for: none yet."""
    return importlib.import_module(_CHECKPOINT_PROCESS)._CHECKPOINT_PROCESS


def set_checkpoint_process(process) -> None:
    """Makes `process` (or None) the one dcp.async_save(..., PROCESS) writes through, instead of starting its own.
    Waits for: none yet (a process given to async_save)."""
    importlib.import_module(_CHECKPOINT_PROCESS)._CHECKPOINT_PROCESS = process


def lighthouse_server_class():
    """torchft's LighthouseServer (None: torchft not installed), loaded without torchft's package __init__, which
    imports torch and the rest of torchft. Measured on 2 loaded cores: `python -c "import torchft.coordination"` (its
    public home) 6.6 to 8.5 s; `distrib lighthouse` to its listening line, with this, 0.24 to 0.59 s. The Rust
    extension needs none of it, and only `distrib lighthouse`'s process calls this, which runs nothing else of
    torchft. Waits for: a torchft.coordination that imports no torch."""
    if "torchft" not in sys.modules:
        spec = importlib.util.find_spec("torchft")
        if spec is None or not spec.submodule_search_locations:
            return None
        package = types.ModuleType("torchft")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchft"] = package
    return importlib.import_module("torchft._torchft").LighthouseServer
