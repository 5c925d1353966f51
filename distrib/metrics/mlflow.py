"""MLflow (`metrics.loggers` names "mlflow"; pip install 'distrib[mlflow]', mlflow-skinny is enough): the resolved
config as run parameters, every log step and evaluation as metrics at our step, summary.json as an artifact.

A resumed run logs into the same MLflow run. Only the client API: no process-wide active run."""

from __future__ import annotations

import os
import time
from pathlib import Path

from distrib.errors import UserError

EXTRA = "pip install 'distrib[mlflow]'"


def require():
    try:
        import mlflow  # noqa: F401 - first the package: its submodules may be imported already
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise UserError(f"metrics.loggers includes mlflow: the mlflow package is not installed; {EXTRA}, "
                        "or remove mlflow from metrics.loggers") from None
    return MlflowClient


class MlflowLogger:
    name = "mlflow"

    def __init__(self, settings, run_dir: Path):
        self.settings, self.run_dir = settings, Path(run_dir)
        self.uri = settings.mlflow_uri
        self._client = self._run_id = None

    def open(self, params: dict, run_id: str | None, resumed_step: int | None) -> str:
        client_class = require()
        from mlflow.environment_variables import MLFLOW_TRACKING_URI

        if not self.uri and not MLFLOW_TRACKING_URI.is_set():
            # MLflow's own default is a sqlite file in the working directory, which mlflow-skinny cannot open.
            self.uri = f"file:{self.run_dir.resolve() / 'mlruns'}"
        if self.uri and self.uri.startswith("file:"):
            # MLflow 3 refuses its file store unless told; naming a file: URI is the user telling it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self._client = client_class(tracking_uri=self.uri or None)
            self._run_id = self._resume(run_id) if run_id else self._create(params)
        except Exception as e:  # noqa: BLE001 - unreachable server, refused store: one line, not a traceback
            raise UserError(f"metrics.loggers includes mlflow: MLflow did not start a run at "
                            f"{self.uri or 'MLFLOW_TRACKING_URI'} ({_first_line(e)}); check "
                            "metrics.mlflow_uri and that the server is up") from None
        return self._run_id

    def _create(self, params: dict) -> str:
        from mlflow.entities import Param

        experiment = self._client.get_experiment_by_name(self.settings.project)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(
            self.settings.project)
        run = self._client.create_run(experiment_id, run_name=self.settings.run_name or self.run_dir.name,
                                      tags={tag: "" for tag in self.settings.tags})
        flat = [Param(key, str(value)[:6000]) for key, value in _flatten(params).items()]
        for start in range(0, len(flat), 100):  # log_batch takes at most 100 parameters
            self._client.log_batch(run.info.run_id, params=flat[start:start + 100])
        return run.info.run_id

    def _resume(self, run_id: str) -> str:
        # Parameters are immutable in MLflow: the resumed run keeps those it started with.
        self._client.update_run(self._client.get_run(run_id).info.run_id, status="RUNNING")
        return run_id

    def log(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(key, float(value), now, step)
                                                      for key, value in values.items()])

    def summary(self, summary: dict) -> None:
        self._client.log_dict(self._run_id, summary, "summary.json")

    def close(self, status: str = "finished") -> None:
        if self._client and self._run_id:
            self._client.set_terminated(self._run_id, "FINISHED" if status == "finished" else "KILLED")
            self._client = self._run_id = None


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"
