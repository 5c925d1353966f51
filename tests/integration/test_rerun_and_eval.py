"""Coming back to a finished run: run again (same run.dir) it trains nothing, one line says so and how to retrain or
extend, summary.json stays byte-identical, `distrib train` exits 0 and fit() returns the summary the run wrote; and
`distrib eval` refuses a fit() run in one line before reading any data."""

import json

import pytest
import torch

from distrib import fit
from distrib.cli import main
from tests.helpers.launch_support import distrib_cmd, run_one
from tests.helpers.support import SMALL

STEPS = {"train.max_steps": 4, "train.epochs": 0, "train.global_batch_size": 32, "train.warmup_steps": 2,
         "run.progress": False, "dist.device": "cpu", "checkpoint.every_steps": 0}


def _tensors(n: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _model(in_channels: int, num_classes: int, image_size: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_channels * image_size ** 2, num_classes))


def _files(run_dir) -> dict[str, bytes]:
    """The run's files but the lock (which records the pid and start of the run holding it)."""
    return {path.name: path.read_bytes() for path in run_dir.iterdir()
            if path.is_file() and path.name != ".distrib.lock"}


def _the_line(text: str) -> str:
    [line] = [line for line in text.splitlines() if "nothing to train" in line]
    return line


def test_fit_again_on_a_finished_run_returns_its_summary_and_writes_nothing(tmp_path, capfd):
    overrides = {**STEPS, "run.dir": str(tmp_path / "run")}
    first = fit(_model, _tensors(128), _tensors(32), overrides=overrides)
    files = _files(tmp_path / "run")
    capfd.readouterr()
    again = fit(_model, _tensors(128), _tensors(32), overrides=overrides)
    line = _the_line(capfd.readouterr().err)
    assert again == json.loads(files["summary.json"]) and again["steps"] == first["steps"] == 4
    assert again["train_loss"] == first["train_loss"] == again["train_loss"]  # a number, not NaN
    assert _files(tmp_path / "run") == files
    assert "4 of 4 steps done" in line and "give a new --set run.dir" in line and "train.max_steps" in line, line


def test_distrib_train_again_on_a_finished_run_exits_0_and_leaves_summary_json(tmp_path, capfd):
    argv = ["train", *[arg for item in (*SMALL, f"run.dir={tmp_path}/run") for arg in ("--set", item)]]
    assert main(argv) == 0
    summary = (tmp_path / "run" / "summary.json").read_bytes()
    capfd.readouterr()
    assert main(argv) == 0
    line = _the_line(capfd.readouterr().err)
    assert (tmp_path / "run" / "summary.json").read_bytes() == summary
    assert line.startswith(f"distrib: {tmp_path}/run: the run is finished (2 of 2 steps done)"), line


def test_distrib_eval_refuses_a_fit_run_before_reading_any_data(tmp_path, capfd, monkeypatch):
    """A fit() run's datasets were given in Python: eval (and predict on a split) say so in one line, exit 2, and
    never load the config's data (Fashion-MNIST by default: 60,000 samples read, or downloaded, for nothing)."""
    import distrib.training.inference as inference

    fit(_model, _tensors(128), _tensors(32), overrides={**STEPS, "run.dir": str(tmp_path / "run")})
    monkeypatch.setattr(inference, "load_data", lambda *args, **kwargs: pytest.fail("loaded the config's data"))
    capfd.readouterr()
    for argv in (["eval", str(tmp_path / "run")], ["predict", str(tmp_path / "run"), "--input", "test", "--out",
                                                     str(tmp_path / "p.jsonl")]):
        assert main(argv) == 2
        err = capfd.readouterr().err.strip()
        assert err.startswith(f"distrib: error: {tmp_path}/run: trained through distrib.fit() on datasets given "
                              "in Python") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run" / "eval.json").exists() and not (tmp_path / "p.jsonl").exists()


@pytest.mark.timeout(150)
def test_a_finished_run_rerun_on_2_workers_exits_0_and_leaves_summary_json(tmp_path):
    """The scheduler's rerun at another world size: every rank learns from rank 0 that the run is finished."""
    items = [*SMALL, f"run.dir={tmp_path}/run"]
    assert main(["train", *[arg for item in items for arg in ("--set", item)]]) == 0
    summary = (tmp_path / "run" / "summary.json").read_bytes()
    done = run_one(distrib_cmd("train", "--nproc-per-node", "2", *[arg for item in items for arg in ("--set", item)]),
                   tmp_path, timeout=120)
    assert done.returncode == 0, done.text()
    assert (tmp_path / "run" / "summary.json").read_bytes() == summary
    assert _the_line(done.stderr).startswith(f"distrib: {tmp_path}/run: the run is finished (2 of 2 steps done)"), \
        done.text()
