"""Experiment trackers: one 2-worker run stores the same metrics in metrics.jsonl, TensorBoard, W&B (offline files)
and MLflow (a file store), each once; the resumed run continues the same tracker runs; a missing package or a
missing login is one line and exit 2 before training, or a warning where metrics.logger_errors = warn."""

import sys

import pytest

from distrib import cli

BASE = ["data.name=synthetic", "data.synthetic_train_size=128", "data.synthetic_test_size=50", "run.progress=false",
        "train.global_batch_size=32", "train.log_every=2", "train.schedule=constant", "train.warmup_steps=2",
        "checkpoint.every_steps=0", "dist.device=cpu", "metrics.project=trackers", 'metrics.tags=["ci","small"]']


def _args(*overrides):
    return [a for o in [*BASE, *overrides] for a in ("--set", o)]


@pytest.mark.parametrize("name, module, extra", [("wandb", "wandb", "distrib[wandb]"),
                                                 ("mlflow", "mlflow", "distrib[mlflow]"),
                                                 ("tensorboard", "torch.utils.tensorboard", "distrib[tensorboard]")])
def test_a_missing_tracker_package_is_one_line_and_exit_2_before_training(tmp_path, capsys, monkeypatch, name,
                                                                         module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # the import fails as if the package were not installed
    code = cli.main(["train", *_args(f"run.dir={tmp_path}", f'metrics.loggers=["jsonl","{name}"]')])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("distrib: error: "), err
    assert f"pip install '{extra}'" in err
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
