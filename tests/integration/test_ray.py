"""Ray Train, for real on a local Ray cluster shared by the module (2 CPUs, 2 workers): distrib.fit inside a
TorchTrainer adopts Ray's process group and ends bitwise equal to torchrun; distrib.integrations.ray.train restarts a
killed worker under FailureConfig(max_failures=1), resumes from distrib's checkpoint and ends bitwise equal to an
uninterrupted run."""

import json
import sys

import pytest
import torch

from tests.helpers.support import REPO, SMALL, assert_ok, load_weights, run, sets, torchrun_train

ray = pytest.importorskip("ray")  # in the dev extra: CI runs these for real

DIE_AT = 3  # rank 1 SIGKILLs itself in step 3 of 4, once (the marker file), after the checkpoint of step 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray cluster for the module; its logs and sockets under a short tmp folder (a socket path has at most
    107 characters). The workers import distrib and tests.helpers from this checkout."""
    folder = tmp_path_factory.mktemp("ray")
    marker = folder / "died"
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(folder / "t"), log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "DISTRIB_TEST_DIE_AT": str(DIE_AT),
                                       "DISTRIB_TEST_DIE_ONCE": str(marker)}})
    try:
        yield folder, marker
    finally:
        ray.shutdown()


def _trainer(loop, storage, **kwargs):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                        run_config=RunConfig(storage_path=str(storage)), **kwargs)


def _fit_loop(loop_config):
    from tests.helpers import fit_small

    fit_small.main(loop_config["run_dir"])


def _summary(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    return {key: value for key, value in summary.items() if key.startswith(("test_", "train_")) or key == "steps"}


@pytest.mark.timeout(300)
def test_fit_inside_a_torch_trainer_equals_torchrun(cluster, tmp_path):
    _trainer(_fit_loop, tmp_path / "ray", train_loop_config={"run_dir": str(tmp_path / "ray-run")}).fit()
    reference = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     str(REPO / "tests" / "helpers" / "fit_small.py"), str(tmp_path / "torchrun-run")], timeout=240)
    assert_ok(reference)
    ours, theirs = load_weights(tmp_path / "ray-run"), load_weights(tmp_path / "torchrun-run")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert _summary(tmp_path / "ray-run") == _summary(tmp_path / "torchrun-run")
    assert _summary(tmp_path / "ray-run")["steps"] == 4


@pytest.mark.timeout(300)
def test_a_killed_worker_restarted_by_ray_resumes_bitwise(cluster, tmp_path):
    from distrib.integrations.ray import train

    _, marker = cluster
    items = [*SMALL, "train.max_steps=4", "checkpoint.every_steps=2", "model.factory=tests.helpers.dying_model:network"]
    overrides = dict(item.split("=", 1) for item in items)
    summary = train(None, {**overrides, "run.dir": str(tmp_path / "ray-run")}, num_workers=2, max_failures=1,
                    storage_path=tmp_path / "ray")
    assert marker.exists(), "rank 1 never died: the restart was not tested"
    assert summary["steps"] == 4
    reference = torchrun_train(2, *sets(*items, f"run.dir={tmp_path / 'torchrun-run'}"), timeout=240)
    assert_ok(reference)
    ours, theirs = load_weights(tmp_path / "ray-run"), load_weights(tmp_path / "torchrun-run")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
