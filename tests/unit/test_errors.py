"""Bad input: one line on stderr naming the field, the value and the fix; exit code 2; no traceback."""

import pytest
import torch

from distrib import cli, data
from distrib.distributed.runtime import read_launch_env, select_device
from distrib.errors import UserError
from tests.helpers.support import SMALL, sets


def _fails(capsys, tmp_path, *overrides, config=None):
    argv = ["train", *sets(*SMALL, f"run.dir={tmp_path}/run", *overrides)]
    if config:
        argv += ["--config", config]
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    last = err.splitlines()[-1]  # progress lines may come first; the error is one line, at the end
    assert last.startswith("distrib: error: ") and err.count("distrib: error") == 1 and "Traceback" not in err, err
    return last


@pytest.mark.parametrize("overrides, expected", [
    (["train.global_batch_size=100", "train.grad_accum_steps=3"], ["train.global_batch_size = 100", "99 or 102"]),
    (["train.global_batch_size=1000"], ["train.global_batch_size = 1000", "256 samples"]),
    (["model.factory=no_such_pkg.models:build"], ["model.factory", "no_such_pkg", "PYTHONPATH"]),
    (["model.factory=tests.helpers.factories:missing"], ["model.factory", "'missing'"]),
    (["model.factory=tests.helpers.factories:not_a_module"], ["model.factory", "str", "nn.Module"]),
    (["train.lr=inf"], ["train.lr", "inf"]),
    (["train.lr=-1"], ["train.lr", "-1"]),
    (["train.optimizer=lamb"], ["train.optimizer", "lamb"]),
])
def test_training_input_errors(capsys, tmp_path, overrides, expected):
    err = _fails(capsys, tmp_path, *overrides)
    for text in expected:
        assert text in err


def test_cuda_without_cuda(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _fails(capsys, tmp_path, "dist.device=cuda")
    assert "dist.device = 'cuda'" in err and "dist.device=cpu" in err


def test_local_rank_beyond_visible_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match="LOCAL_RANK=3 but 2 CUDA device.*--nproc-per-node=2"):
        select_device("auto", 3)


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_PORT is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 with WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
])
def test_inconsistent_launch_env(env, expected):
    with pytest.raises(UserError, match=expected):
        read_launch_env(env)


def test_missing_data_offline(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(data.idx.SYSTEM_DIRS, "fashion-mnist", [tmp_path / "no-debian-package"])

    def offline(name, root):
        raise OSError("network unreachable")  # what a download on an offline machine gets; no network touched

    monkeypatch.setattr(data.idx, "download", offline)
    err = _fails(capsys, tmp_path, "data.name=fashion-mnist", f"data.root={tmp_path}/data")
    for text in ("data.root", "Fashion-MNIST not found", "no-debian-package", "apt-get install dataset-fashion-mnist",
                 "data.name=synthetic", "OSError"):
        assert text in err
