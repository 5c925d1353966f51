"""Exact resume against an uninterrupted reference: stop and resume, a killed worker restarted by the launcher,
SIGTERM, and a checkpoint moved to another world size."""


import pytest
import torch


def test_a_schedule_shorter_than_the_run_is_refused():
    from distrib.config import TrainConfig
    from distrib.errors import ConfigError
    from distrib.training.optimizers import build_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(ConfigError, match=r"train.schedule_steps = 50: shorter than this run's 80 steps"):
        build_scheduler(optimizer, 80, TrainConfig(schedule_steps=50))
    assert build_scheduler(optimizer, 80, TrainConfig(schedule_steps=100)).get_last_lr()[0] > 0
