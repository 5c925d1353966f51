"""Mistakes found before anything is touched, and a full disk: one line naming the path, what is wrong and the fix;
exit code 2 (the input) or 74 (the machine); an earlier run's files in the folder byte-identical afterwards."""

import errno
from pathlib import Path

import pytest

from distrib.config import load_config
from distrib.errors import EXIT_ENVIRONMENT, UserError
from distrib.worker import run_training
from tests.helpers.nothing_lost import BASE, fails, train_argv
from tests.helpers.support import snapshot


def _untouched(folder: Path, before: dict) -> None:
    assert snapshot(folder) == before  # every earlier file byte for byte, and no new one (but the lock)


@pytest.mark.parametrize("overrides, expected", [
    (["checkpoint.dir={tmp}/a_file"], ["checkpoint.dir = '", "a_file': is a file, not a folder",
                                                    "--set checkpoint.dir="]),
    (["run.dir={tmp}/a_file"], ["run.dir = '", "a_file': is a file, not a folder", "--set run.dir="]),
    (["run.dir={tmp}/a_file/run"], ["run.dir = '", "cannot be created", "a_file is a file"]),
    (["checkpoint.signals=SIGTERM,SIGKILL"], ["checkpoint.signals", "SIGKILL cannot be caught",
                                                           "SIGTERM,SIGUSR1"]),
    (["checkpoint.signals=STOP"], ["checkpoint.signals", "STOP cannot be caught"]),
    (["model.factory=tests.helpers.other_models:linear", "checkpoint.allow_config_change=true", "train.max_steps=9"],
     ["checkpoint ", "step_00000006.pt: does not fit this run's model", "Missing key(s) in state_dict"]),
])
def test_bad_folders_signals_and_checkpoints(capsys, tmp_path, folder, overrides, expected):
    (tmp_path / "a_file").write_text("keep me\n")
    before = snapshot(folder)
    err = fails(capsys, train_argv(folder, *[o.format(tmp=tmp_path) for o in overrides]))
    for text in expected:
        assert text in err, err
    _untouched(folder, before)
    assert (tmp_path / "a_file").read_text() == "keep me\n"


def test_a_checkpoint_dir_that_is_a_file_stops_the_worker_before_training(tmp_path, folder):
    """The same check in the worker (torchrun runs it without our CLI), before the first step, not at the final save."""
    (tmp_path / "a_file").write_text("keep me\n")
    before = snapshot(folder)
    with pytest.raises(UserError, match="checkpoint.dir = .*a_file': is a file"):
        run_training(load_config(None, [*BASE, f"run.dir={folder}", f"checkpoint.dir={tmp_path}/a_file",
                                         "train.max_steps=9"]))
    _untouched(folder, before)


@pytest.mark.parametrize("argv, expected", [
    (["--nproc-per-node", "0"], "--nproc-per-node 0: must be at least 1"),
    (["--nproc-per-node=-1"], "--nproc-per-node -1: must be at least 1"),
    (["--config", "{tmp}"], "is a folder, not a file"),
    (["--config", "{tmp}/latin1.toml"], "not UTF-8 text (byte 0xe9 at offset 21)"),
])
def test_bad_arguments(capsys, tmp_path, folder, argv, expected):
    (tmp_path / "latin1.toml").write_bytes("[run]\nprogress = \"caf\xe9\"\n".encode("latin-1"))
    before = snapshot(folder)
    err = fails(capsys, [*train_argv(folder), *[a.format(tmp=tmp_path) for a in argv]])
    assert expected in err, err
    _untouched(folder, before)


def test_a_full_disk_under_the_metrics_is_one_line_too(capsys, folder, monkeypatch):
    from distrib.metrics import Recorder

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "metrics.jsonl"))

    monkeypatch.setattr(Recorder, "write", full)
    err = fails(capsys, train_argv(folder, "train.max_steps=12"), code=EXIT_ENVIRONMENT)
    assert err == (f"distrib: error: {folder}/metrics.jsonl: No space left on device; free some space or fix the "
                   "filesystem, then run the same command again (it resumes from the last checkpoint)")
