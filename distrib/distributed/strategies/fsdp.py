"""The sharded strategies: fsdp (FSDP2 over one shard group of every data-parallel rank), hsdp (replicas of shard
groups, a 2-D mesh: its subclass in .hsdp) and either composed with tensor parallel (dist.tensor_parallel, the
innermost mesh dimension). They differ only by the mesh (ParallelDims); this class owns their model's life.

Start-up: the model is built on the meta device, split by tensor parallel, sharded by fully_shard, and only this
rank's shards are materialised on its device (distrib.distributed.strategies.materialise), then filled by the
weights to load (model.init_from), the model's own initialisation, or rank 0's whole copy. Steady state: each rank
holds its shards of parameters, gradients and optimizer state, all-gathers a block's parameters for its forward and
backward, reduce-scatters its gradients, and saves its own shards (DCP)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from distrib.config import DistConfig
from distrib.distributed import fsdp
from distrib.distributed.mesh import build_mesh, group_split
from distrib.distributed.parallel import mismatch_error, place_model, unwrap
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import materialise
from distrib.distributed.strategies.base import Build, Strategy
from distrib.distributed.strategies.ddp import compiled, prepare
from distrib.distributed.tensor_parallel import apply_tensor_parallel

# On the CPU, glibc keeps the whole parameters a sharded model gathers and frees block by block in its heap (the fsdp
# workers of a 203M-parameter GPT peaked at 1.8-2.1x its bytes instead of 0.92x) unless the runtime fixes its mmap
# threshold, which makes every large host tensor a fresh mapping to fault in: 1.4-2x the CPU time per step of a 28M
# or a 0.8M GPT, measured. Above this size a model's memory is worth it; below, neither the model nor what glibc
# keeps of it is large (docs/performance.md, "The host allocator"; distrib.distributed.host_heap). Under tcmalloc
# (distrib's launcher preloads it) the same rule turns on its decommit: 1.20 instead of 1.37-1.44x for a 104M GPT under
# AdamW.
RETURN_FREED_MEMORY_FROM_BYTES = 64 * 2**20


def _return_freed_memory_if_large(model: nn.Module, runtime: Runtime) -> None:
    if sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) \
            >= RETURN_FREED_MEMORY_FROM_BYTES:
        runtime.return_freed_host_memory()


@contextlib.contextmanager
def _requires_gradient_sync(module, enabled: bool) -> Iterator[None]:
    module.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


class FSDPStrategy(Strategy):
    names = ("fsdp",)
    sharded_state = True

    @classmethod
    def replicas_and_shards(cls, config: DistConfig, data_parallel: int, world_size: int,
                            local_world_size: int) -> tuple[int, int]:
        return 1, data_parallel  # one shard group of every data-parallel rank

    def shard(self, model: nn.Module, runtime: Runtime, precision: str, device_type: str) -> nn.Module:
        """The run's mesh (device_type explicit: a CPU run on a GPU host, or distrib plan's fake group), tensor
        parallel on its innermost dimension, then FSDP2 over the others. distrib plan calls this too."""
        mesh = build_mesh(self.dims, device_type)
        if self.dims.tensor_parallel > 1:  # first, so that FSDP shards the tensor-parallel slices over the others
            apply_tensor_parallel(model, mesh["tp"])
        return fsdp.shard(model, runtime, self.config, precision, mesh)

    def setup_module(self, build: Build, runtime: Runtime) -> nn.Module:
        if build.given is not None:  # a module given to distrib.fit: whole on every rank already, each keeps slices
            _return_freed_memory_if_large(build.given, runtime)
            model = place_model(build.given, runtime.device)
            prepare(model, build.speed, self.config.shard_modules)
            model = self.shard(model, runtime, build.precision, runtime.device.type)
            if build.load_weights is not None:
                build.load_weights(model)
            return compiled(model, build.speed)
        buffers = {}
        if build.load_weights is not None:  # no initialisation to run: the weights come from the file
            model, buffers = materialise.build_for_loading(build.factory, build.seed)
        else:
            model = materialise.build_on_meta(build.factory, build.seed)
        _return_freed_memory_if_large(model, runtime)  # before any shard is materialised
        self_init = build.load_weights is None and materialise.initialises_itself(model)
        prepare(model, build.speed, self.config.shard_modules)
        model = self.shard(model, runtime, build.precision, runtime.device.type)
        self._materialise(model, runtime)
        self._fill(model, build, runtime, self_init, buffers)
        return compiled(model, build.speed)

    def _fill(self, model: nn.Module, build: Build, runtime: Runtime, self_init: bool,
              buffers: dict[str, torch.Tensor]) -> None:
        """The materialised shards' values: the loaded weights (and the constructor's non-persistent buffers), the
        model's own initialisation, or rank 0's whole copy."""
        if build.load_weights is not None:
            materialise.restore_buffers(model, buffers)
            build.load_weights(model)
            build.log("the model was built on the meta device and each rank materialised only its shards, filled by "
                      "the weights loaded (model.init_from, or the checkpoint resumed): no rank held the model whole")
        elif self_init:
            materialise.init_shards(model, build.seed)
        else:
            materialise.load_from_rank0(model, build.factory, build.seed, runtime, build.log)

    def _materialise(self, model: nn.Module, runtime: Runtime) -> None:
        """Empty shards and buffers where they live (shards in host memory under dist.cpu_offload), then the
        device-mismatch listing of every local shard and buffer: the model is never whole, so this is where a
        tensor the model pins elsewhere shows."""
        host = torch.device("cpu")
        model.to_empty(device=host if self.state_on_host else runtime.device)
        if self.state_on_host:
            for module in model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    module._buffers[name] = buffer.to(runtime.device)
        found = [line for line in materialise.check_materialised(model, runtime.device)
                 if not (self.state_on_host and line.startswith("parameter") and line.endswith(f"on {host}"))]
        if found:
            raise mismatch_error(found, runtime.device, "register these tensors with nn.Parameter or register_buffer "
                                 "so that model.to(device) moves them, and do not pin them to a device")

    def grad_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        # FSDP reduce-scatters in the backward unless told not to (it then keeps unsharded gradients until the last).
        return _requires_gradient_sync(getattr(model, "_orig_mod", model), enabled)

    def after_forward_only(self, model: nn.Module) -> None:
        # With dist.reshard_after_forward = false (and for the root module always) a forward leaves the parameters
        # gathered until a backward reshards them; an optimizer built then, or a checkpoint taken after an
        # evaluation, would see the gathered tensors, not the shards (torch's state_dict helpers then crashed).
        fsdp.reshard(unwrap(model))

    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, named: bool = False) -> dict:
        return fsdp.sharded_state(unwrap(model), optimizer)

    def load_training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if fsdp.keyed_by_name(state["optimizer"]):  # DCP shards, resharded to this mesh
            fsdp.load_sharded_state(unwrap(model), optimizer, state)
        else:  # a one-file checkpoint: each rank keeps its slices of the whole
            fsdp.load_full_state(unwrap(model), optimizer, state)

    def full_model_state(self, model: nn.Module) -> dict:
        return fsdp.full_model_state(unwrap(model))

    def plan_module(self, model: nn.Module, runtime: Runtime, precision: str) -> nn.Module:
        return self.shard(model, runtime, precision, "cpu")

    @property
    def state_on_host(self) -> bool:
        return self.config.cpu_offload

    def step_traffic(self, per_node: int, local_params: int, compute_bytes: int, grad_accum: int,
                     reshard_after_forward: bool, tp_activation_bytes: float = 0) -> tuple[float, float]:
        """All-gathers of parameters in every forward (and backward, when resharded) of every micro-step, one
        reduce-scatter of fp32 gradients; hsdp then all-reduces its gradient shards across the replicas; tensor
        parallel all-reduces tp_activation_bytes per micro-step within its group."""
        dims, tp = self.dims, self.dims.tensor_parallel
        parts = [group_split(tp, 1, per_node, tp_activation_bytes * grad_accum, 2) if tp > 1 else (0, 0)]
        gathered = local_params * dims.shard
        gathers = grad_accum * (2 if reshard_after_forward else 1)
        parts += [group_split(dims.shard, tp, per_node, gathered * compute_bytes, gathers),
                  group_split(dims.shard, tp, per_node, gathered * 4, 1)]
        if dims.replicate > 1:
            parts.append(group_split(dims.replicate, dims.shard * tp, per_node, local_params * 4, 2))
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def startup_memory(self, parameter_bytes_per_rank: int, whole_bytes: int, largest_tensor_bytes: int,
                       self_initialising: bool, nproc_per_node: int, params_on_host: bool) -> tuple[int, int]:
        # Each rank materialises only its shards. A self-initialising model adds one whole tensor at a time on each
        # rank's host; any other is built whole once, on rank 0's host.
        extra = largest_tensor_bytes if self_initialising else whole_bytes
        shards_on_host = nproc_per_node * parameter_bytes_per_rank if params_on_host else 0
        per_node = (nproc_per_node * extra if self_initialising else extra) + shards_on_host
        return parameter_bytes_per_rank + extra, per_node
