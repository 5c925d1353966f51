"""Ray Train, for real on a local Ray cluster shared by the module (2 CPUs): distrib.fit inside a TorchTrainer of 2
workers adopts Ray's process group; a worker killed mid-run is restarted by Ray (FailureConfig(max_failures=1)), fit
resumes from its own checkpoint and ends bitwise equal to the same script under torchrun, with the same summary.json
metrics; distrib.integrations.ray.train equals distrib's own run. Cost: see docs/development.md, CI."""

import json
import shutil
import sys
import tempfile

import pytest
import ray  # in the dev extra: CI runs these for real, never skipped
import torch

from tests.helpers.support import REPO, SMALL, assert_ok, load_weights, run, small_config

DIE_AT = 3  # rank 1 SIGKILLs itself in step 3 of fit_small's 4, once (the marker file), after the step-2 checkpoint


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray cluster for the module. Its logs and sockets go to a short folder of its own under /tmp, removed
    after: a socket's path has at most 107 characters, and Ray's session folder adds about 60 to pytest's temp folder
    (over 50 under xdist). The workers import distrib and tests.helpers from this checkout."""
    marker = tmp_path_factory.mktemp("ray") / "died"
    ray_temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=ray_temp, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "DISTRIB_TEST_DIE_AT": str(DIE_AT),
                                       "DISTRIB_TEST_DIE_ONCE": str(marker)}})
    try:
        yield marker
    finally:
        ray.shutdown()
        shutil.rmtree(ray_temp, ignore_errors=True)


def _fit_loop(loop_config):
    from tests.helpers import fit_small

    fit_small.main(loop_config["run_dir"])


def _summary(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    return {key: value for key, value in summary.items() if key.startswith(("test_", "train_")) or key == "steps"}


@pytest.mark.timeout(300)
def test_fit_inside_a_torch_trainer_restarted_after_a_kill_equals_torchrun(cluster, tmp_path):
    """Rank 1 SIGKILLs itself in step 3, after the checkpoint of step 2; Ray restarts both workers
    (FailureConfig(max_failures=1)), fit resumes: the weights and summary.json's metrics are torchrun's."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marker = cluster
    TorchTrainer(_fit_loop, train_loop_config={"run_dir": str(tmp_path / "ray-run")},
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                 run_config=RunConfig(storage_path=str(tmp_path / "ray"),
                                      failure_config=FailureConfig(max_failures=1))).fit()
    assert marker.exists(), "rank 1 never died: the restart was not tested"
    assert json.loads((tmp_path / "ray-run" / "summary.json").read_text())["resumed_from_step"] == 2
    reference = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     str(REPO / "tests" / "helpers" / "fit_small.py"), str(tmp_path / "torchrun-run")], timeout=240,
                    env={"PYTHONPATH": str(REPO)})  # the script imports tests.helpers (CI sets no PYTHONPATH)
    assert_ok(reference)
    ours, theirs = load_weights(tmp_path / "ray-run"), load_weights(tmp_path / "torchrun-run")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert _summary(tmp_path / "ray-run") == _summary(tmp_path / "torchrun-run")
    assert _summary(tmp_path / "ray-run")["steps"] == 4


@pytest.mark.timeout(300)
def test_the_cli_run_on_ray_equals_distrib_train(cluster, tmp_path):
    """distrib.integrations.ray.train runs what `distrib train` runs (world size 1 here: its reference is this
    process's own run, no launch)."""
    from distrib.integrations.ray import train
    from distrib.worker import run_training

    summary = train(None, dict(item.split("=", 1) for item in (*SMALL, f"run.dir={tmp_path / 'ray-run'}")),
                    num_workers=1, storage_path=tmp_path / "ray")
    reference = run_training(small_config(tmp_path / "run"))
    ours, theirs = load_weights(tmp_path / "ray-run"), load_weights(tmp_path / "run")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert summary["steps"] == reference["steps"] == 2 and summary["test_loss"] == reference["test_loss"]
