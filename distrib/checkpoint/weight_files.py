"""The names of a run's exported weight files and their size limit, and how the ranks writing them agree that a
write failed: what the writers (weights, adapter_weights, run_weights), the export check and init_from share."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from distrib.errors import EnvironmentFault

WEIGHTS_DIR, SINGLE, INDEX = "weights", "model.safetensors", "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"  # an adapter run's weights/ holds it, as PeftModel.save_pretrained names it
MAX_FILE_BYTES = 5 * 2**30  # model.max_shard_size's default (save_pretrained's max_shard_size)


def agree_write(error: str | None) -> None:
    """Every rank learns whether any rank failed (the first reason), so that none waits in the next collective."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = next((e for e in errors if e), None)
    if failed:
        raise EnvironmentFault(failed)


def write_fault(folder: Path, e: OSError) -> str:
    return (f"{folder}: the weights cannot be written ({e.strerror}); free some space or fix the folder "
            "(permissions, a read-only mount), then run the same command again")
