"""Device placement: every parameter, buffer and batch tensor on the worker's device, or an error naming each one."""

import pytest
import torch
import torch.nn as nn

from distrib import cli
from distrib.distributed.parallel import check_batch, explain_device_errors, misplaced_tensors, place_model, unwrap
from distrib.errors import DeviceMismatchError
from distrib.models.network import Network
from tests.helpers.support import SMALL, sets

CPU = torch.device("cpu")


def _train_error(capsys, tmp_path, factory):
    argv = ["train", *sets(*SMALL, "data.synthetic_train_size=64", "train.max_steps=1", "train.global_batch_size=8",
                           f"run.dir={tmp_path}", f"model.factory=tests.helpers.factories:{factory}")]
    assert cli.main(argv) == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_network_has_the_seed_lessons_shape():
    shapes = {name: tuple(p.shape) for name, p in Network().named_parameters()}
    assert shapes == {"conv1.weight": (6, 1, 5, 5), "conv1.bias": (6,), "conv2.weight": (12, 6, 5, 5),
                      "conv2.bias": (12,), "fc1.weight": (120, 192), "fc1.bias": (120,), "fc2.weight": (60, 120),
                      "fc2.bias": (60,), "out.weight": (10, 60), "out.bias": (10,)}
    assert Network()(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_meta_parameter_from_a_factory_is_named(capsys, tmp_path):
    err = _train_error(capsys, tmp_path, "meta_parameter")
    assert "device mismatch, expected cpu" in err and "parameter scale is on meta" in err and "to_empty" in err
    assert "conv1" not in err  # only the offender is listed


def test_buffer_that_stays_behind_after_to_is_named(capsys, tmp_path):
    err = _train_error(capsys, tmp_path, "pinned_buffer")
    assert "buffer offset is on meta" in err and "register_buffer" in err


def test_mismatch_inside_a_step_is_re_raised_with_the_listing(capsys, tmp_path):
    err = _train_error(capsys, tmp_path, "forward_makes_meta")
    assert "forward() made a tensor elsewhere" in err and "PyTorch said:" in err and "device=input.device" in err


def test_batch_tensors_are_checked_by_name():
    with pytest.raises(DeviceMismatchError, match="batch tensor targets is on meta"):
        check_batch({"inputs": torch.zeros(2), "targets": torch.zeros(2, device="meta")}, CPU)
    check_batch({"inputs": torch.zeros(2)}, CPU)


def test_explain_lists_model_and_batch_culprits():
    model = nn.Linear(2, 2)
    batch = {"inputs": torch.zeros(1, 2, device="meta")}
    with pytest.raises(DeviceMismatchError) as info, explain_device_errors(model, CPU, batch):
        raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
    assert "batch tensor inputs is on meta" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="unrelated"), explain_device_errors(model, CPU, batch):
        raise RuntimeError("unrelated")  # other errors pass through untouched


def test_place_model_and_listing_on_a_device_the_model_is_not_on():
    model = place_model(Network(), CPU)
    assert not misplaced_tensors(model, CPU)
    found = misplaced_tensors(model, torch.device("meta"))
    assert len(found) == 10 and found[0] == "parameter conv1.weight is on cpu"
    assert unwrap(model) is model
