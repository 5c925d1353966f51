"""Mistakes found before anything is touched, and a full disk: one line naming the path, what is wrong and the fix;
exit code 2 (the input) or 74 (the machine); an earlier run's files in the folder byte-identical afterwards."""

import errno
import shutil
from pathlib import Path

import pytest
import torch

from distrib import cli
from distrib.checkpoint import format as checkpoint
from distrib.config import load_config
from distrib.errors import EXIT_ENVIRONMENT
from distrib.worker import run_training
from tests.helpers.support import snapshot

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


def _fails(capsys, argv: list[str], code: int = 2) -> str:
    got = cli.main(argv)
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert got == code and last.startswith("distrib: error: "), err
    assert err.count("distrib: error") == 1 and "Traceback" not in err, err
    return last


def _train(folder: Path, *overrides: str) -> list[str]:
    return ["train", *[a for o in [*BASE, f"run.dir={folder}", *overrides] for a in ("--set", o)]]


@pytest.mark.parametrize("fault", ["OSError", "torch zip writer"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_how_much_space_is_needed(capsys, folder, monkeypatch,
                                                                                     fault):
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if "checkpoints" in getattr(f, "name", ""):
            f.write(b"the first bytes fit")
            if fault == "OSError":
                raise OSError(errno.ENOSPC, "No space left on device")
            # What a real full tmpfs gives: torch's zip writer loses the errno.
            monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6, 0))
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 141952 vs 141864")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    before = snapshot(folder)
    err = _fails(capsys, _train(folder, "train.max_steps=12"), code=EXIT_ENVIRONMENT)
    assert EXIT_ENVIRONMENT == 74
    for text in (f"{folder}/checkpoints/step_00000009.pt: no space left on the device", "needs about 0.",
                 "MB are free", f"the newest checkpoint, {folder}/checkpoints/step_00000006.pt, is intact",
                 "run the same command again"):
        assert text in err, err
    after = snapshot(folder)
    for name in ("checkpoints/step_00000003.pt", "checkpoints/step_00000006.pt", "model.pt", "summary.json"):
        assert after[name] == before[name], name
    assert sorted(n for n in after if n.startswith("checkpoints/")) == \
        ["checkpoints/.distrib-run", "checkpoints/step_00000003.pt", "checkpoints/step_00000006.pt"]  # no temp file
    monkeypatch.undo()
    # space again: it resumes
    resumed = run_training(load_config(None, [*BASE, f"run.dir={folder}", "train.max_steps=12"]))
    assert resumed["resumed_from_step"] == 6 and resumed["steps"] == 12
