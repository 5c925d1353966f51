"""The end of a worker's run, and its evaluations: exact metrics of the test (or validation) set, the weights written
(weights/, model.pt where it is cheap), model.json, the memory line, summary.json and the last log line."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch.nn as nn

from distrib.checkpoint.run_weights import write_run_weights
from distrib.checkpoint.weight_files import WEIGHTS_DIR
from distrib.config import Config
from distrib.data import Data
from distrib.distributed import dimensions
from distrib.distributed.mesh import ParallelDims
from distrib.distributed.parallel import memory_report, unwrap
from distrib.distributed.runtime import Runtime
from distrib.metrics import Recorder
from distrib.metrics.recorder import headline
from distrib.training.evaluation import Task, evaluate
from distrib.training.losses import Loss
from distrib.training.state import TrainState


def evaluator(config: Config, runtime: Runtime, dims: ParallelDims, data: Data, loss: Loss, task: Task,
               split: str = "test") -> Callable[[nn.Module], dict]:
    """Exact metrics of the test set, or of the validation set (split "val": the same metrics named val_*)."""
    source = data.val if split == "val" else data.test

    def evaluate_model(model: nn.Module) -> dict:
        metrics = evaluate(model, source, data.info.num_classes, config.data.eval_batch_size, runtime, loss,
                           config.train.precision, data.info.class_names, task, dims)
        return {f"{split}_{key.removeprefix('test_')}" if key.startswith("test_") else key: value
                for key, value in metrics.items()}

    return evaluate_model


def _memory(config: Config, runtime: Runtime, state: TrainState, recorder: Recorder) -> dict:
    """state_bytes_per_rank (and peak_memory_bytes on CUDA), the fullest rank's, into the log. A collective."""
    memory = memory_report(state.model, state.optimizer, runtime)
    peak, dims = memory["peak_memory_bytes"], state.strategy.dims
    layout = dimensions.layout_words(dims)  # spelt out where the strategy's name does not say what a rank holds
    recorder.info(f"parameters + gradients + optimizer state: {memory['state_bytes_per_rank'] / 2**20:.1f} MiB on "
                  f"the fullest rank ({config.dist.strategy}{layout})"
                  + (f"; peak device memory {peak / 2**20:.1f} MiB" if peak else ""))
    return memory


def finish_run(config: Config, runtime: Runtime, data: Data, state: TrainState, metrics: dict, meter, recorder,
            resumed_from: int | None, start: float, from_config: bool) -> dict:
    """The weights (weights/, and model.pt where it is cheap), model.json (which says how to rebuild a config's
    model), summary.json, the last log line."""
    run_dir = Path(config.run.dir)
    written = write_run_weights(unwrap(state.model), state.ema, run_dir, runtime.rank, state.strategy,
                                config.model.init_from, config.model.merged_weights, recorder.info,
                                config.model.max_shard_bytes)
    memory = _memory(config, runtime, state, recorder)
    if runtime.is_main:
        if from_config:  # a model given to distrib.fit in Python has no factory that model.json could name
            from distrib.training.inference import write_model_card

            write_model_card(run_dir / "model.json", config, data.info,
                             "model.pt" if "model.pt" in written else f"{WEIGHTS_DIR}/")
    elapsed = time.perf_counter() - start
    summary = {"world_size": runtime.world_size, "device": str(runtime.device), "backend": runtime.backend,
               "steps": state.progress.step, "epochs": state.progress.epoch, **metrics,
               "resumed_from_step": resumed_from, "restart_count": runtime.restart_count,
               **({"best_checkpoints": state.best.describe()} if state.best else {}),
               **meter.summary(), **memory, "elapsed_seconds": elapsed, "data": data.info.to_dict()}
    recorder.write_summary(summary)
    recorder.info(f"done in {elapsed:.1f}s: {headline(metrics)}, summary in {run_dir / 'summary.json'}")
    recorder.close()
    return summary
