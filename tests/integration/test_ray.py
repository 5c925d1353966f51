"""Ray Train, for real on a local Ray cluster shared by the module (2 CPUs): distrib.fit inside a TorchTrainer of 2
workers adopts Ray's process group; a worker killed mid-run is restarted by Ray (FailureConfig(max_failures=1)), fit
resumes from its own checkpoint and ends bitwise equal to the same script under torchrun, with the same summary.json
metrics; distrib.integrations.ray.train equals distrib's own run. Cost: see docs/development.md, CI."""

import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import threading
from unittest import mock

import pytest
import ray  # in the dev extra: CI runs these for real, never skipped
import torch

from tests.helpers.processes import kill_remaining, own_processes
from tests.helpers.support import EVENT_S, REPO, SMALL, assert_ok, load_weights, run, small_config

DIE_AT = 3  # rank 1 SIGKILLs itself in step 3 of fit_small's 4, once (the marker file), after the step-2 checkpoint
# A test's hard limit, for a hang only (every wait ends at its event: the trainer's end, torchrun's exit). Measured
# beside two busy loops and other tests on 2 cores (load 8): 240 s for the first test, ray.init included.
HANG_S = 900


# Ray's settings for the test cluster: each of Ray's defaults named here guesses how fast the machine is.
SYSTEM_CONFIG = {
    # Ray starts its workers (the trainer's controller and workers) at nice 15: beside processes at nice 0 (the other
    # test process's launches on CI, anything else on a busy machine) each gets a weight of 36 against their 1024.
    # Measured on a 2-core machine beside two busy loops: 312 s to start the 2 workers, and the test timed out.
    "worker_niceness": 0,
    # A worker process that has not registered with its raylet within 60 s (Ray's default) is killed as hung; under
    # load a Python process that imports Ray can take that long. Only a worker that hangs waits this out, and the
    # test's own timeout comes first.
    "worker_register_timeout_seconds": 600,
}


class _Cluster:
    """A local Ray cluster (2 CPUs) in this process, and every process of it ended on stop(). Its logs and sockets go
    to a short folder under /tmp, removed after (a socket's path has at most 107 characters, and Ray's session folder
    adds about 60 to pytest's, over 50 under xdist). The workers import distrib and tests.helpers from this checkout."""

    def __init__(self, marker):
        self.marker = marker

    def start(self) -> None:
        """Waits for the node however long it takes to start (the test's timeout is the limit). ray.init gives the
        raylet RAY_raylet_start_wait_time_s (30 s) to register, and the raylet first waits for its agent, a Python
        process: beside two busy loops and other tests (load 13 on 2 cores) 8 tries in a row failed so. After a
        failed lookup a constant 30 s of Ray's still holds: then the cluster is started again."""
        while True:
            self.temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
            try:
                with mock.patch.dict(os.environ, {"RAY_raylet_start_wait_time_s": "600"}):
                    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=self.temp, log_to_driver=False,
                             _system_config=SYSTEM_CONFIG,
                             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "DISTRIB_TEST_DIE_AT": str(DIE_AT),
                                                       "DISTRIB_TEST_DIE_ONCE": str(self.marker)}})
                return
            except BaseException as error:  # also the test's timeout (pytest's Failed): nothing of Ray left behind
                self.stop()
                if "timed out during startup" not in str(error):
                    raise

    def stop(self) -> None:
        processes = own_processes()  # Ray's daemons and workers; its agents outlive a raylet that was killed
        try:
            ray.shutdown()
        finally:  # also when the test's timeout comes in ray.shutdown
            kill_remaining(processes)
            shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def _module_cluster(tmp_path_factory):
    ray_cluster = _Cluster(tmp_path_factory.mktemp("ray") / "died")
    ray_cluster.start()
    try:
        yield ray_cluster
    finally:
        ray_cluster.stop()


@pytest.fixture
def cluster(_module_cluster, request):
    """The module's cluster, started anew after a test that failed: a test that times out leaves its trainer
    running, and the next test's trainer would wait for the CPUs it holds (for ever: Ray retries a worker group that
    cannot start without limit)."""
    num_failed = request.session.testsfailed  # counts a test's call as soon as it fails, before its teardown
    yield _module_cluster.marker
    if request.session.testsfailed > num_failed:
        _module_cluster.stop()
        _module_cluster.start()


def _in_thread(function, *args, **kwargs):
    """function(*args, **kwargs), called in a thread of its own, for a trainer's fit(): it waits in ray.get, which
    lets no exception but KeyboardInterrupt through, so the test's timeout (pytest-timeout raises in the main thread)
    would wait for the trainer's end, for ever if it hangs. Waiting here, the test ends at its timeout, and its
    teardown stops the cluster under the thread's fit."""
    future = concurrent.futures.Future()

    def call():
        try:
            future.set_result(function(*args, **kwargs))
        except BaseException as error:  # raised in the test's thread
            future.set_exception(error)

    threading.Thread(target=call, daemon=True).start()
    return future.result()


def _fit_loop(loop_config):
    from tests.helpers import fit_small

    fit_small.main(loop_config["run_dir"])


def _summary(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    return {key: value for key, value in summary.items() if key.startswith(("test_", "train_")) or key == "steps"}


@pytest.mark.timeout(HANG_S)
def test_fit_inside_a_torch_trainer_restarted_after_a_kill_equals_torchrun(cluster, tmp_path):
    """Rank 1 SIGKILLs itself in step 3, after the checkpoint of step 2; Ray restarts both workers
    (FailureConfig(max_failures=1)), fit resumes: the weights and summary.json's metrics are torchrun's."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    marker = cluster
    trainer = TorchTrainer(_fit_loop, train_loop_config={"run_dir": str(tmp_path / "ray-run")},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=str(tmp_path / "ray"),
                                                failure_config=FailureConfig(max_failures=1)))
    _in_thread(trainer.fit)
    assert marker.exists(), "rank 1 never died: the restart was not tested"
    assert json.loads((tmp_path / "ray-run" / "summary.json").read_text())["resumed_from_step"] == 2
    reference = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                     str(REPO / "tests" / "helpers" / "fit_small.py"), str(tmp_path / "torchrun-run")], timeout=EVENT_S,
                    env={"PYTHONPATH": str(REPO)})  # the script imports tests.helpers (CI sets no PYTHONPATH)
    assert_ok(reference)
    ours, theirs = load_weights(tmp_path / "ray-run"), load_weights(tmp_path / "torchrun-run")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert _summary(tmp_path / "ray-run") == _summary(tmp_path / "torchrun-run")
    assert _summary(tmp_path / "ray-run")["steps"] == 4


@pytest.mark.timeout(HANG_S)
def test_the_cli_run_on_ray_equals_distrib_train(cluster, tmp_path):
    """distrib.integrations.ray.train runs what `distrib train` runs (world size 1 here: its reference is this
    process's own run, no launch)."""
    from distrib.integrations.ray import train
    from distrib.worker import run_training

    summary = _in_thread(train, None, dict(item.split("=", 1) for item in (*SMALL, f"run.dir={tmp_path / 'ray-run'}")),
                         num_workers=1, storage_path=tmp_path / "ray")
    reference = run_training(small_config(tmp_path / "run"))
    ours, theirs = load_weights(tmp_path / "ray-run"), load_weights(tmp_path / "run")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    assert summary["steps"] == reference["steps"] == 2 and summary["test_loss"] == reference["test_loss"]
