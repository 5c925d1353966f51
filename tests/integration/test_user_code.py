"""The user's own data, model and loss, from code outside the project (a temp dir on PYTHONPATH): `distrib train` and
`distrib.fit` at world size 2 against `distrib train` in one process, and every model/data mismatch as one line with
nothing written to run.dir."""

import json
import os
import sys
import textwrap

import pytest

from distrib import cli
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, SMALL, assert_ok, distrib, load_weights, max_relative_diff, run, sets
from tests.helpers.user_package import write_user_package

# 10 SGD steps of a small ResNet (GroupNorm) on 3x32x32 samples in 100 classes. A small lr: at 0.05 this narrow net
# on near-random labels amplifies the float noise between world sizes to 2.5e-4 in a bias of norm 0.006 (1e-6 here).
USER_RUN = [*SMALL, "data.factory=userpkg.data:cifar100_like", "data.kwargs={num_train = 256, num_test = 100}",
            "model.factory=userpkg.models:resnet", "model.kwargs={width = 4}", "train.max_steps=10", "train.epochs=0",
            "train.global_batch_size=16", "train.warmup_steps=5", "train.log_every=10", "train.lr=0.01"]
COUNTS = ("test_accuracy", "test_top5_accuracy", "test_count", "test_per_class_accuracy")

FIT_SCRIPT = '''
"""A user's script: their data and model, trained by distrib.fit. python train.py RUN_DIR (or under torchrun)."""
import functools
import sys

from userpkg.data import cifar100_like
from userpkg.models import resnet

from distrib import fit

train, test = cifar100_like(num_train=256, num_test=100)
summary = fit(functools.partial(resnet, width=4), train, test, overrides={
    "run.dir": sys.argv[1], "train.max_steps": 10, "train.epochs": 0, "train.global_batch_size": 16, "train.lr": 0.01,
    "train.warmup_steps": 5, "train.log_every": 10, "run.progress": False, "dist.device": "cpu",
    "checkpoint.every_steps": 0})
print(f"rank done: test accuracy {summary['test_accuracy']:.3f} over {summary['test_count']} samples")
'''


@pytest.fixture(scope="module")
def user_root(tmp_path_factory):
    return write_user_package(tmp_path_factory.mktemp("outside"))


def _env(user_root) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(user_root), str(REPO), os.environ.get("PYTHONPATH", "")])}


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def one_process_run(user_root, tmp_path_factory):
    """`distrib train` at world size 1 in this process (a process start spared), the user's package on sys.path for
    it alone."""
    run_dir = tmp_path_factory.mktemp("ws1")
    sys.path.insert(0, str(user_root))
    try:
        assert cli.main(["train", *sets(*USER_RUN, f"run.dir={run_dir}")]) == 0
    finally:
        sys.path.remove(str(user_root))
        for name in [name for name in sys.modules if name.split(".")[0] == "userpkg"]:
            del sys.modules[name]
    return run_dir


def _assert_same_training(run_dir, reference) -> None:
    diff = max_relative_diff(load_weights(run_dir), load_weights(reference))
    assert diff < 1e-5, diff
    got, want = _summary(run_dir), _summary(reference)
    assert got["steps"] == 10 and got["test_count"] == 100 and "test_top5_accuracy" in got
    # The weights differ by float noise (the all-reduce sums in another order), so the loss agrees to about that;
    # what is counted (accuracies, per class) is the same.
    assert {k: got[k] for k in COUNTS} == {k: want[k] for k in COUNTS}
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-5)


@pytest.mark.timeout(900)
def test_user_data_and_model_through_distrib_train_at_world_sizes_1_and_2(user_root, one_process_run, tmp_path):
    summary = _summary(one_process_run)
    assert summary["data"]["input_shape"] == [3, 32, 32] and summary["data"]["num_classes"] == 100
    assert len(summary["test_per_class_accuracy"]) == 100
    assert_ok(distrib("train", "--nproc-per-node", "2", *sets(*USER_RUN, f"run.dir={tmp_path}"), timeout=EVENT_S,
                      env=_env(user_root)))
    assert _summary(tmp_path)["world_size"] == 2
    _assert_same_training(tmp_path, one_process_run)


@pytest.mark.timeout(900)
def test_user_script_with_fit_under_torchrun(user_root, one_process_run, tmp_path):
    """The user's script at world size 2 against `distrib train` in one process. (A fit script run as one process:
    test_api.py's examples.)"""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FIT_SCRIPT).lstrip())
    assert len(script.read_text().splitlines()) <= 20
    two = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
               str(tmp_path / "two")], timeout=EVENT_S, env=_env(user_root))
    assert_ok(two)
    assert two.stdout.count("rank done: test accuracy") == 2 and _summary(tmp_path / "two")["world_size"] == 2
    _assert_same_training(tmp_path / "two", one_process_run)
