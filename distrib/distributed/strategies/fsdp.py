"""The sharded state: fsdp (FSDP2 over one shard group of every data-parallel rank) and hsdp (the same with a
replicate degree: replicas of shard groups), under any tensor-parallel degree, and every pipeline (its stages are
FSDP2 modules whatever dist.strategy says). They differ only by the mesh (ParallelDims); this class owns their
model's life.

Start-up: the model is built on the meta device, laid out by the one parallelize (a pipeline rank's stages cut first:
distrib.distributed.pipeline), and only this rank's shards are materialised on its device
(distrib.distributed.strategies.materialise), then filled by the weights to load (model.init_from), the model's own
initialisation, or rank 0's whole copy. Steady state: each rank holds its shards of parameters, gradients and
optimizer state, all-gathers a block's parameters for its forward and backward, reduce-scatters its gradients, and
saves its own shards (DCP)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from distrib.config import DistConfig, SpeedConfig
from distrib.distributed import dimensions, fsdp
from distrib.distributed.parallel import mismatch_error, place_model, unwrap
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies import materialise
from distrib.distributed.strategies.base import Build, Strategy
from distrib.errors import ConfigError

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
    names = ("fsdp", "hsdp")
    sharded_state = True

    @classmethod
    def replicas_and_shards(cls, config: DistConfig, data_parallel: int, world_size: int,
                            local_world_size: int) -> tuple[int, int]:
        """fsdp: one shard group of every data-parallel rank; hsdp: groups of dist.shard_size ranks (one node's, by
        default: a node holds a group's ranks times those that read the same micro-batch, the innermost, as FSDP2
        shards over them: ParallelDims.batch_sharers), replicated across the groups."""
        if config.strategy == "fsdp":
            return 1, data_parallel
        sharers = world_size // (config.pipeline_parallel * data_parallel)  # the ranks that read each micro-batch
        shard = config.shard_size or max(1, min(data_parallel, local_world_size // sharers))
        if data_parallel % shard:
            per_node = "LOCAL_WORLD_SIZE" + (f" / {sharers} (ranks that read each micro-batch)" if sharers > 1 else "")
            key = "dist.shard_size" if config.shard_size else f"{per_node} (dist.shard_size)"
            taken = "".join(f" / {d.name} {share}" for d, share in dimensions.shares(config, world_size,
                                                                                    local_world_size) if share > 1)
            raise ConfigError(f"{key} = {shard}: does not divide the {data_parallel} data-parallel ranks (world size "
                              f"{world_size}{taken}); set --set dist.shard_size to a divisor of {data_parallel}, e.g. "
                              "the ranks of one node")
        return data_parallel // shard, shard

    # ---------------------------------------------------------------- the model's life

    def setup_module(self, build: Build, runtime: Runtime) -> nn.Module:
        self.dims.build_mesh(runtime.device.type)
        given, buffers = build.given is not None, {}
        if given:  # a module given to distrib.fit: whole on every rank already, each keeps its slices
            whole = place_model(build.given, runtime.device)
        elif build.load_weights is not None:  # no initialisation to run: the weights come from the file
            whole, buffers = materialise.build_for_loading(build.factory, build.seed)
        else:
            whole = materialise.build_on_meta(build.factory, build.seed)
        _return_freed_memory_if_large(whole, runtime)  # before any shard is materialised or gathered
        self_init = not given and build.load_weights is None and materialise.initialises_itself(whole)
        model = self._lay_out(whole, runtime, build.speed, build.precision, build.log)
        if not given:
            self._materialise(model, runtime)
            self._fill(model, whole, build, runtime, self_init, buffers)
        elif build.load_weights is not None:
            build.load_weights(model)
        for line in self.runner.describe():
            build.log(line)
        return model

    def _lay_out(self, whole: nn.Module, runtime: Runtime, speed: SpeedConfig, precision: str, log) -> nn.Module:
        """The model as the runner runs it, laid out by the one parallelize: the whole model, or under pipeline
        parallel runtime.rank's stages of it, which the runner then holds."""
        return self.runner.lay_out(whole, self.dims, self.config, runtime, speed=speed, precision=precision, log=log)

    def _fill(self, model: nn.Module, whole: nn.Module, build: Build, runtime: Runtime, self_init: bool,
              buffers: dict[str, torch.Tensor]) -> None:
        """The materialised shards' values: the loaded weights (and the constructor's non-persistent buffers), the
        whole model's own initialisation (each rank's tensors drawn as one process draws them), or rank 0's whole
        copy."""
        if build.load_weights is not None:
            materialise.restore_buffers(model, buffers)
            build.load_weights(model)
            build.log("the model was built on the meta device and each rank materialised only its shards, filled by "
                      "the weights loaded (model.init_from, or the checkpoint resumed): no rank held the model whole")
        elif self_init:
            materialise.init_shards(whole, build.seed)
        else:
            materialise.load_from_rank0(model, build.factory, build.seed, runtime, build.log,
                                        part=self.runner.holds_part)

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
        # A pipeline's runner does not ask: its schedule's stages reduce their gradients after their last backward.
        return _requires_gradient_sync(model, enabled)

    def after_forward_only(self, model: nn.Module) -> None:
        # With dist.reshard_after_forward = false (and for the root module always) a forward leaves the parameters
        # gathered until a backward reshards them; an optimizer built then, or a checkpoint taken after an
        # evaluation, would see the gathered tensors, not the shards (torch's state_dict helpers then crashed).
        for root in self.runner.roots(model):
            fsdp.reshard(root)

    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, named: bool = False) -> dict:
        return fsdp.sharded_state(unwrap(model), optimizer)

    def load_training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if fsdp.keyed_by_name(state["optimizer"]):  # DCP shards, resharded to this mesh
            fsdp.load_sharded_state(unwrap(model), optimizer, state)
        else:  # a one-file checkpoint: each rank keeps its slices of the whole
            self.runner.check_one_file_state()
            fsdp.load_full_state(unwrap(model), optimizer, state)

    def full_model_state(self, model: nn.Module) -> dict:
        return self.runner.full_model_state(model)

    def plan_module(self, model: nn.Module, runtime: Runtime, precision: str,
                    speed: SpeedConfig = SpeedConfig()) -> nn.Module:
        """The meta model as runtime.rank holds it (under pipeline parallel: its pipeline rank's stages), laid out by
        the run's own calls over distrib plan's fake group (whose own rank is 0: the data-parallel coordinates are rank
        0's, the fullest shards); speed: the options that change the module (the dry run's activation checkpointing)."""
        self.dims.build_mesh("cpu")
        return self._lay_out(model, runtime, speed, precision, lambda line: None)

    @property
    def state_on_host(self) -> bool:
        return self.config.cpu_offload
