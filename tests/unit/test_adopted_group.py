"""A process group already open (Ray Train's TorchTrainer opens one before its train_loop_per_worker) is adopted by
open_runtime and left open; one that does not match the launch environment or the device is one line naming both."""

import pytest
import torch.distributed as dist

from distrib.config import DistConfig
from distrib.distributed.runtime import LaunchEnv, open_runtime, read_launch_env
from distrib.errors import UserError


@pytest.fixture
def gloo_group():
    """A world-1 gloo group this test opened, as Ray would have."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_an_open_group_is_adopted_and_left_open(gloo_group):
    group = dist.group.WORLD
    with open_runtime(DistConfig(device="cpu"), LaunchEnv()) as runtime:
        assert dist.group.WORLD is group and runtime.peers is None
        assert (runtime.rank, runtime.world_size, runtime.backend) == (0, 1, "gloo")
    assert dist.is_initialized() and dist.group.WORLD is group  # its owner closes it, not distrib


def test_an_open_group_of_another_world_size_is_one_line(gloo_group):
    env = LaunchEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=1)
    with pytest.raises(UserError) as raised:
        with open_runtime(DistConfig(device="cpu"), env):
            pass
    line = str(raised.value)
    assert "\n" not in line and "world size 1" in line and "WORLD_SIZE=2" in line and "RANK=1" in line
    assert dist.is_initialized()  # refused, not destroyed


def test_an_open_group_whose_backend_cannot_serve_the_device_is_one_line(gloo_group):
    from distrib.distributed.runtime import adopted_backend

    with pytest.raises(UserError) as raised:
        adopted_backend(LaunchEnv(), "nccl")  # what dist.device = cuda needs
    line = str(raised.value)
    assert "\n" not in line and "'gloo'" in line and "'nccl'" in line and "use_gpu=True" in line


def test_ray_trains_variables_are_read_by_the_one_reader():
    env = read_launch_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                           "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (3, 1, 4, 2, 1)
    assert env.launched and not env.elastic  # Ray's actors are not tied to a torch agent


def test_a_workers_user_error_reaches_the_ray_driver_as_its_one_line():
    """What Ray's WorkerGroupError holds (measured on a local cluster: a CUDA run on a CPU machine's workers);
    distrib.integrations.ray.train raises the first rank's UserError, found through the causes Ray wraps it in."""
    from ray.train import WorkerGroupError

    from distrib.integrations.ray import _user_error

    mistake = UserError("dist.device = 'cuda': CUDA is not available on this machine; use --set dist.device=cpu")
    wrapped = RuntimeError("the worker's task failed")
    wrapped.__cause__ = mistake
    assert _user_error(WorkerGroupError("rank 0, 1", {1: RuntimeError("other"), 0: wrapped})) is mistake
    assert _user_error(WorkerGroupError("rank 0", {0: RuntimeError("not ours")})) is None
    assert _user_error(ValueError("no workers")) is None
