"""Experiment trackers: one 2-worker run stores the same metrics in metrics.jsonl, TensorBoard, W&B (offline files)
and MLflow (a file store), each once; the resumed run continues the same tracker runs; a missing package or a
missing login is one line and exit 2 before training, or a warning where metrics.logger_errors = warn."""

import json
import os

import pytest

from distrib import cli
from distrib.metrics.jsonl import last_attempt
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, assert_ok, distrib, free_port, torchrun_train
from tests.helpers.wandb_records import read_run

BASE = ["data.name=synthetic", "data.synthetic_train_size=128", "data.synthetic_test_size=50", "run.progress=false",
        "train.global_batch_size=32", "train.log_every=2", "train.schedule=constant", "train.warmup_steps=2",
        "checkpoint.every_steps=0", "dist.device=cpu", "metrics.project=trackers", 'metrics.tags=["ci","small"]']
ALL = 'metrics.loggers=["jsonl","tensorboard","wandb","mlflow"]'


def _args(*overrides):
    return [a for o in [*BASE, *overrides] for a in ("--set", o)]


def _jsonl(run_dir) -> dict[str, list]:
    """{metric: [(step, value), ...]} of a run's metrics.jsonl, as its readers see it (one history)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return _by_key(r for r in last_attempt(records) if "event" not in r)


def _by_key(rows) -> dict[str, list]:
    series = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, []).append((row["step"], value))
    return series


def _mlflow(uri: str) -> tuple[list, dict[str, list]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("trackers").experiment_id])
    series = {key: [(m.step, m.value) for m in sorted(client.get_metric_history(runs[0].info.run_id, key),
                                                         key=lambda m: (m.step, m.timestamp))]
              for key in runs[0].data.metrics}
    return runs, series


def _tensorboard(run_dir) -> dict[str, list]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _board_tag(key: str) -> str:
    return f"test/{key[5:]}" if key.startswith("test_") else f"train/{key}" if key in ("loss", "lr") \
        else f"throughput/{key}"


def _assert_same(expected: dict, stored: dict, rel: float = 0.0) -> None:
    assert expected.keys() == stored.keys(), expected.keys() ^ stored.keys()
    for key in expected:
        assert [s for s, _ in stored[key]] == [s for s, _ in expected[key]], key
        assert [v for _, v in stored[key]] == pytest.approx([v for _, v in expected[key]], rel=rel, abs=0), key


@pytest.mark.timeout(900)
def test_every_tracker_stores_what_metrics_jsonl_holds_once_and_a_resumed_run_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this test's reader; the run sets it for a file: URI
    run_dir, uri = tmp_path / "run", f"file:{tmp_path}/mlruns"
    env = {"WANDB_MODE": "offline", "PYTHONPATH": str(REPO)}
    assert_ok(torchrun_train(2, *_args(f"run.dir={run_dir}", ALL, f"metrics.mlflow_uri={uri}", "train.max_steps=8"),
                             env=env, timeout=EVENT_S))
    expected = _jsonl(run_dir)
    assert {"loss", "lr", "test_loss", "test_accuracy", "samples_per_second"} <= expected.keys()
    assert [s for s, _ in expected["loss"]] == [2, 4, 6, 8] and [s for s, _ in expected["test_loss"]] == [4, 8]

    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # one run: rank 1 logs nothing
    config, history, summary = read_run(wandb_file)
    _assert_same(expected, _by_key(history))
    assert config["train"]["global_batch_size"] == 32 and config["metrics"]["project"] == "trackers"
    assert summary["stop_reason"] == "completed" and summary["steps"] == 8

    runs, series = _mlflow(uri)
    assert len(runs) == 1 and runs[0].data.params["train.global_batch_size"] == "32"
    assert set(runs[0].data.tags) >= {"ci", "small"} and runs[0].info.status == "FINISHED"
    _assert_same(expected, series)
    summary_file = json.loads((run_dir / "summary.json").read_text())
    from mlflow.tracking import MlflowClient

    artifact = MlflowClient(tracking_uri=uri).download_artifacts(runs[0].info.run_id, "summary.json", str(tmp_path))
    assert json.loads(open(artifact).read()) == summary_file

    board = {key: values for key, values in expected.items() if key != "epoch"}
    _assert_same({_board_tag(k): v for k, v in board.items()}, _tensorboard(run_dir), rel=1e-6)  # float32

    # Extended on one worker: the same W&B run id and the same MLflow run, continued past step 8.
    assert_ok(distrib("train", *_args(f"run.dir={run_dir}", ALL, f"metrics.mlflow_uri={uri}", "train.max_steps=12"),
                      env=env, timeout=EVENT_S))
    expected = _jsonl(run_dir)
    assert [s for s, _ in expected["loss"]] == [2, 4, 6, 8, 10, 12]
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name  # run-ID.wandb: the same id, continued
    _assert_same(expected, _by_key(row for f in files for row in read_run(f)[1]))
    runs, series = _mlflow(uri)
    assert len(runs) == 1
    _assert_same(expected, series)


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_a_missing_tracker_package_stops_the_launch_before_any_worker(tmp_path, name, package):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / f"{package}.py").write_text(f'raise ImportError("No module named {package}")\n')  # as if not installed
    result = distrib("train", "--nproc-per-node", "2", *_args(f"run.dir={tmp_path}/run", f'metrics.loggers=["{name}"]'),
                     env={"PYTHONPATH": f"{shim}{os.pathsep}{REPO}"}, timeout=EVENT_S)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("distrib: error: ") and f"pip install 'distrib[{name}]'" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(900)
def test_no_wandb_login_fails_at_start_or_warns_and_trains_on(tmp_path, capsys, monkeypatch):
    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no stored login either
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    args = _args(f"run.dir={tmp_path}/run", 'metrics.loggers=["wandb"]', "train.max_steps=4")
    assert cli.main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("distrib: error: metrics.loggers includes wandb: W&B did not start a run"), err
    assert "wandb login" in err[-1] and not (tmp_path / "run" / "summary.json").exists()

    assert cli.main(["train", *args, "--set", "metrics.logger_errors=warn"]) == 0
    err = capsys.readouterr().err
    assert "warning: metrics.loggers includes wandb" in err and "continuing without wandb" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from_step"] is None


@pytest.mark.timeout(900)
def test_an_unreachable_mlflow_server_is_one_line_and_exit_2_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries would take minutes
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = cli.main(["train", *_args(f"run.dir={tmp_path}", 'metrics.loggers=["mlflow"]', f"metrics.mlflow_uri={uri}",
                                     "train.max_steps=4")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"distrib: error: metrics.loggers includes mlflow: MLflow did not start "
                                            f"a run at {uri} ("), err
    assert "check metrics.mlflow_uri and that the server is up" in err[-1]
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "summary.json").exists()
