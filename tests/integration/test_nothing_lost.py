"""Mistakes found before anything is touched, and a full disk: one line naming the path, what is wrong and the fix;
exit code 2 (the input) or 74 (the machine); an earlier run's files in the folder byte-identical afterwards."""

import errno
import shutil

import pytest
import torch

from distrib.checkpoint import format as checkpoint
from distrib.config import load_config
from distrib.errors import EXIT_ENVIRONMENT
from distrib.worker import run_training
from tests.helpers.nothing_lost import BASE, fails, train_argv
from tests.helpers.support import snapshot


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
    err = fails(capsys, train_argv(folder, "train.max_steps=12"), code=EXIT_ENVIRONMENT)
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
