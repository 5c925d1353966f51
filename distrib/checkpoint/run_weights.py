"""What a run writes at its end: the trained weights as safetensors (a peft model's as its adapter and merged model),
the EMA's, and where cheap model.pt, each checked by loading it back. Above the writers and the export check."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from distrib.checkpoint.adapter_weights import save_adapter_run
from distrib.checkpoint.export_check import agree_checked, check_folder, check_state_folder
from distrib.checkpoint.format import save_atomic
from distrib.checkpoint.weight_files import MAX_FILE_BYTES, WEIGHTS_DIR, agree_write
from distrib.checkpoint.weights import hf_config, model_pt_is_cheap, model_tensors, save_weights
from distrib.distributed.strategies import Strategy
from distrib.errors import EnvironmentFault
from distrib.models.adapters import is_peft


def write_run_weights(model: nn.Module, ema, run_dir: Path, rank: int, strategy: Strategy, init_from: str = "",
                      merged_weights: bool = True, log=lambda line: None, max_file_bytes: int = MAX_FILE_BYTES
                      ) -> list[str]:
    """Every rank: the unwrapped model's weights into run_dir/weights/ (and the EMA's into weights_ema/), shard by
    shard in files of at most max_file_bytes (the strategy's save of trained weights), checked by loading them back;
    a peft model's as its adapter and weights/merged/ (distrib.checkpoint.adapter_weights). Then, where
    model_pt_is_cheap, model.pt and model_ema.pt (the whole wrapped state, which the config's model takes back),
    written by rank 0 one at a time. Returns the names of those written (the same on every rank)."""
    tensors = strategy.complete(model, model_tensors(model))  # under pipeline parallel: every stage's names
    folder = Path(run_dir) / WEIGHTS_DIR
    if is_peft(model):
        save_adapter_run(model, tensors, folder, rank, init_from, merged_weights, log, max_file_bytes)
    else:
        save_weights(tensors, folder, rank, hf_config(model), max_file_bytes)
        agree_checked(rank, lambda: check_folder(folder, model, tensors))
    if ema is not None:
        averaged, ema_folder = strategy.complete(model, ema.state_dict()), Path(run_dir) / f"{WEIGHTS_DIR}_ema"
        save_weights(averaged, ema_folder, rank, max_file_bytes=max_file_bytes)
        shapes = {name: tuple(tensor.shape) for name, tensor in averaged.items()}
        agree_checked(rank, lambda: check_state_folder(ema_folder, shapes))
    if not model_pt_is_cheap(tensors, strategy.sharded_state, max_file_bytes):
        return []
    whole = {"model.pt": lambda: strategy.full_model_state(model)}  # a sharded model is gathered onto rank 0
    if ema is not None:
        whole["model_ema.pt"] = lambda: strategy.whole_on_rank0(ema.full_state_dict())  # a gather under fsdp
    for name, gather in whole.items():
        _save_whole(gather, Path(run_dir) / name, rank)
    return list(whole)


def _save_whole(gather, path: Path, rank: int) -> None:
    """Every rank: gather() (a collective), and rank 0 writes what it returns to `path`, then lets it go before the
    next file is gathered: rank 0 never holds more than one whole file above the other ranks."""
    state, error = gather(), None
    if rank == 0:
        try:
            save_atomic(state, path)
        except EnvironmentFault as e:
            error = str(e)
    del state
    agree_write(error)  # no rank goes on to the next gather while rank 0's write failed
