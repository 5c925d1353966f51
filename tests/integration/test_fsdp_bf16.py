"""fsdp + bf16 trains a BatchNorm model (its norm layers kept in fp32) like ddp + bf16 does. In-process, but two
bf16 trainings on the CPU take seconds: this lane."""

import pytest
import torch

from distrib.cli import main
from tests.helpers.support import load_weights, max_relative_diff, sets

RUN = ("data.name=synthetic", "data.synthetic_train_size=128", "data.synthetic_test_size=32",
       "data.synthetic_shape=[1,8,8]", "train.max_steps=6", "train.global_batch_size=16", "train.warmup_steps=1",
       "train.lr=0.1", "train.schedule=constant", "train.precision=bf16", "run.progress=false", "dist.device=cpu",
       "checkpoint.every_steps=0",
       "model.factory=tests.helpers.other_models:conv_batchnorm")


@pytest.mark.timeout(900)
def test_fsdp_bf16_trains_a_batchnorm_model_like_ddp(tmp_path):
    for strategy in ("ddp", "fsdp"):
        assert main(["train", *sets(*RUN, f"dist.strategy={strategy}", f"run.dir={tmp_path / strategy}")]) == 0
    fsdp, ddp = load_weights(tmp_path / "fsdp"), load_weights(tmp_path / "ddp")
    assert all(value.dtype == torch.float32 for value in fsdp.values() if value.is_floating_point())
    # bf16 rounds every op to 3 significant digits, and the two round in other places (BatchNorm outputs: bf16 under
    # ddp's autocast, fp32 under fsdp); measured 5e-3 apart after 6 steps, while ddp + fp32 is 3e-2 from both.
    assert max_relative_diff(fsdp, ddp) < 1e-2, max_relative_diff(fsdp, ddp)
