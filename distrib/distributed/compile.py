"""speed.compile: torch.compile on each block of the model, in place, after tensor parallel and before sharding
(torchtitan's order: tensor parallel, activation checkpointing, compile, FSDP), and what compiling cannot take.

In place (nn.Module.compile) keeps every parameter's name: state dicts and checkpoints carry no `_orig_mod.` prefix.
Under ddp the whole model is compiled over DDP instead (distrib.distributed.strategies.ddp), where dynamo splits
its graphs at DDP's gradient buckets so that the all-reduce overlaps the backward."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.nn as nn

from distrib.config import SpeedConfig
from distrib.distributed.parallel import unwrap
from distrib.errors import UserError
from distrib.torch_private import compiled_in_place

# Where the log's line on compiling ends: the first forwards compile, and the throughput figures leave out the steps
# that did (metrics.timing_skip_steps, 5 by default, covers step 1's compile of the training graphs).
_WARM_UP = "its warm-up (compiling in the first steps) stays out of samples/s (metrics.timing_skip_steps)"


def _outermost(blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks inside no other block: compiling the outer one traces the inner ones with it."""
    inside = {id(module) for block in blocks for module in list(block.modules())[1:]}
    return [block for block in blocks if id(block) not in inside]


def _counted(modules: list[nn.Module]) -> str:
    """'4 Block' or '3 Linear and 2 Conv2d', in the order the classes first appear."""
    counts = Counter(type(module).__name__ for module in modules)
    said = [f"{count} {name}" for name, count in counts.items()]
    return said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1]


def compile_blocks(model: nn.Module, blocks: list[nn.Module], speed: SpeedConfig) -> str:
    """torch.compile each of `blocks` (the modules dist.shard_modules names, within `model`: a whole model, or one
    pipeline stage of it) in place, in speed.compile_mode; `model` itself when there are none. Call it after tensor
    parallel and before fully_shard: FSDP's hooks, registered afterwards, stay outside the compiled graphs (they
    are dynamo-disabled). Returns the log's line saying what was compiled."""
    compiled = _outermost(blocks) or [model]
    for module in compiled:
        module.compile(mode=speed.compile_mode)
    what = (f"{_counted(compiled)} blocks, each" if blocks
            else f"the whole {type(model).__name__} (dist.shard_modules found no blocks)")
    return f"speed.compile: compiled {what} in place before sharding, mode {speed.compile_mode}; {_WARM_UP}"


def compile_whole(wrapped: nn.Module, speed: SpeedConfig) -> tuple[nn.Module, str]:
    """torch.compile over the DDP-wrapped model (not the reverse): dynamo then splits its graphs at DDP's buckets,
    so the all-reduce overlaps the backward. Returns the compiled module and the log's line."""
    line = (f"speed.compile: compiled the whole {type(unwrap(wrapped)).__name__} over DDP (its graphs split at DDP's "
            f"gradient buckets), mode {speed.compile_mode}; {_WARM_UP}")
    return torch.compile(wrapped, mode=speed.compile_mode), line


def _class_name(module: nn.Module) -> str:
    """The model's own class name, under the FSDP<name> subclass that fully_shard swaps in."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule)).__name__


def compiled_classes(model: nn.Module) -> list[str]:
    """The classes of the modules of `model` compiled in place (by compile_blocks), in order, each once."""
    return list(dict.fromkeys(_class_name(module) for module in model.modules()
                              if compiled_in_place(module)))


@contextlib.contextmanager
def explain_compile_errors(model: nn.Module) -> Iterator[None]:
    """Around a forward (and backward) of a model that may be compiled (its first): torch.compile's failures (dynamo
    cannot trace an op, inductor cannot build a kernel) as one line naming speed.compile, the compiled classes and
    the fix. Dynamo is imported only to tell its exceptions from others."""
    try:
        yield
    except Exception as e:
        from distrib.torch_private import TorchDynamoException

        if not isinstance(e, TorchDynamoException):
            raise
        classes = compiled_classes(model) or [_class_name(unwrap(model))]
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        said = lines[0] if lines else type(e).__name__
        explained = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
        raise UserError(f"speed.compile = true: torch.compile cannot take {', '.join(classes)} ({type(e).__name__}: "
                        f"{said[:160]}{'; ' + explained[:240] if explained else ''}); fix: --set speed.compile=false, "
                        "or make the model traceable (docs/performance.md, Compiling)") from e
