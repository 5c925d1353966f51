"""What both lanes' nothing-lost tests share: one small config, a finished earlier run (its folder copied for each
test), and the checks of a refused run (one line, the exit code, no traceback)."""

import shutil
from pathlib import Path

import pytest

from distrib import cli
from distrib.config import load_config
from distrib.worker import run_training

BASE = ["data.name=synthetic", "data.synthetic_train_size=256", "data.synthetic_test_size=64", "run.progress=false",
        "train.global_batch_size=32", "train.schedule=constant", "train.warmup_steps=2", "train.log_every=3",
        "train.eval_every_epochs=0", "dist.device=cpu", "checkpoint.every_steps=3"]


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    """A finished run: config.toml, metrics.jsonl, summary.json, model.pt, checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("earlier")
    run_training(load_config(None, [*BASE, f"run.dir={run_dir}", "train.max_steps=6"]))
    return run_dir


@pytest.fixture
def folder(tmp_path, earlier) -> Path:
    shutil.copytree(earlier, tmp_path / "run")
    return tmp_path / "run"


def fails(capsys, argv: list[str], code: int = 2) -> str:
    got = cli.main(argv)
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert got == code and last.startswith("distrib: error: "), err
    assert err.count("distrib: error") == 1 and "Traceback" not in err, err
    return last


def train_argv(folder: Path, *overrides: str) -> list[str]:
    return ["train", *[a for o in [*BASE, f"run.dir={folder}", *overrides] for a in ("--set", o)]]
