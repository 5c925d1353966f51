"""`distrib.integrations.ray.train`: what `distrib train` does, run by Ray Train's TorchTrainer on a Ray cluster.
Ray starts the workers, sets the launch environment and opens the process group (distrib adopts it); distrib's own
checkpoints in checkpoint.dir, on storage every worker shares, carry the run across Ray's restarts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from distrib.config import Config
from distrib.errors import UserError


def _absolute(config: Config) -> Config:
    """run.dir and checkpoint.dir as absolute paths: Ray's workers run in folders of Ray's own choosing."""
    from distrib.api import resolve_config

    overrides = {"run.dir": str(Path(config.run.dir).absolute())}
    if config.checkpoint.dir:
        overrides["checkpoint.dir"] = str(Path(config.checkpoint.dir).absolute())
    return resolve_config(config, overrides)


def _train_loop(loop_config: dict) -> None:
    """Ray's train_loop_per_worker: `distrib train`'s worker, inside the group Ray opened; every rank reports the
    summary (Ray keeps rank 0's)."""
    import ray.train

    from distrib.config import load_config
    from distrib.worker import run_training

    summary = run_training(load_config(None, [], base=loop_config["config"]))
    ray.train.report({key: value for key, value in summary.items() if isinstance(value, (int, float, str))})


def _user_error(error: BaseException) -> UserError | None:
    """The first distrib UserError among Ray's worker failures (WorkerGroupError.worker_failures, in rank order),
    through the causes Ray wraps them in."""
    failures = getattr(error, "worker_failures", None) or {}
    for _, failure in sorted(failures.items()):
        seen = 0
        while failure is not None and seen < 8:  # RayTaskError keeps the worker's exception as .cause
            if isinstance(failure, UserError):
                return failure
            failure, seen = getattr(failure, "cause", None) or failure.__cause__, seen + 1
    return None


def train(config: str | Path | Config | None = None, overrides: Mapping[str, Any] | None = None, *,
          num_workers: int = 2, use_gpu: bool | None = None, max_failures: int = 0,
          storage_path: str | Path | None = None, name: str | None = None) -> dict:
    """Trains as `distrib train` does, on `num_workers` Ray Train workers (one per GPU with use_gpu, which defaults
    to dist.device == "cuda"); returns the run's summary (summary.json; where the driver does not see run.dir,
    the numbers and strings rank 0 reported to Ray).

    config, overrides: as for distrib.fit (a TOML path or a Config, then {"section.key": value}). run.dir and
    checkpoint.dir must be on storage every worker's node reads and writes (one machine: any folder).
    max_failures: how often Ray restarts the workers after one fails (FailureConfig); each restart resumes from
    distrib's last checkpoint in checkpoint.dir (checkpoint.every_steps says how often one is written).
    storage_path, name: where Ray keeps its own records of the run (RunConfig; default ~/ray_results).
    A mistake in the input found by the workers (a distrib UserError) is raised here as that one UserError.

    >>> from distrib.integrations.ray import train  # doctest: +SKIP
    >>> train("configs/tiny.toml", {"dist.device": "cpu"}, num_workers=2, max_failures=1)  # doctest: +SKIP
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from distrib.api import resolve_config
    from distrib.config import check_world_size, to_dict

    resolved = _absolute(resolve_config(config, overrides))  # a bad config fails here, before any worker starts
    check_world_size(resolved.train.global_batch_size, resolved.train.grad_accum_steps, num_workers)
    use_gpu = resolved.dist.device == "cuda" if use_gpu is None else use_gpu
    trainer = TorchTrainer(
        _train_loop, train_loop_config={"config": to_dict(resolved)},
        # The group Ray opens has the timeout distrib would give its own (dist.timeout_s).
        torch_config=TorchConfig(timeout_s=math.ceil(resolved.dist.timeout_s)),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(name=name, storage_path=str(storage_path) if storage_path else None,
                             failure_config=FailureConfig(max_failures=max_failures)))
    try:
        result = trainer.fit()
    except Exception as e:
        mistake = _user_error(e)
        if mistake is not None:  # a mistake every worker makes alike: its one line, not Ray's report of each rank
            raise mistake.with_traceback(None) from None
        raise
    summary = Path(resolved.run.dir) / "summary.json"  # rank 0 wrote it; the driver sees it on shared storage
    return json.loads(summary.read_text()) if summary.is_file() else dict(result.metrics or {})
