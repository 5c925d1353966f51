"""Samples of different lengths end to end: tokenized texts of 8 to 32 ids, unpadded, from user code outside the
project, padded per micro-batch by distrib, train a Hugging Face GPT2LMHeadModel (its own loss) the same at world
sizes 1 and 2; test_loss is the mean over every counted test position, as the model computes it sample by sample."""

import json
import os
import sys

import pytest
import torch

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, SMALL, assert_ok, distrib, load_weights, max_relative_diff, sets
from tests.helpers.task_package import write_task_package

# SGD: GPT-2's attention has a key bias, whose true gradient is zero; Adam would scale its rounding noise, which
# differs between world sizes (docs/data.md, "Tasks").
RAGGED = [*SMALL, "data.factory=taskpkg.data:ragged_lm", "model.factory=taskpkg.models:gpt2",
          "model.kwargs={seq_len = 32}", "train.epochs=0", "train.max_steps=12", "train.global_batch_size=16",
          "train.warmup_steps=2", "train.lr=0.1", "train.log_every=4"]


@pytest.fixture
def task_root(tmp_path):
    root = write_task_package(tmp_path / "outside")
    sys.path.insert(0, str(root))  # the in-process run and the independent check import taskpkg too
    yield root
    sys.path.remove(str(root))


@pytest.mark.timeout(600)
def test_ragged_token_samples_padded_by_distrib_agree_across_world_sizes(task_root, tmp_path):
    from taskpkg.data import ragged_lm
    from taskpkg.models import gpt2

    one = run_training(load_config(None, [*RAGGED, f"run.dir={tmp_path}/one"]))
    env = {"PYTHONPATH": os.pathsep.join([str(task_root), str(REPO)])}
    result = distrib("train", "--nproc-per-node", "2", *sets(*RAGGED, f"run.dir={tmp_path}/two"), env=env,
                     timeout=EVENT_S)
    assert_ok(result)
    assert "a mean over the labels' counted positions shifted by one" in result.stderr
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["world_size"] == 2 and two["steps"] == 12
    assert max_relative_diff(load_weights(tmp_path / "two"), load_weights(tmp_path / "one")) < 1e-5

    # Each test text alone, unpadded: the mean over all their predicted positions is the reported test_loss.
    _, test = ragged_lm()
    model = gpt2(seq_len=32)
    model.load_state_dict(load_weights(tmp_path / "one"))
    with torch.no_grad():
        sums = [model.eval()(**{key: value[None] for key, value in test[i].items()}).loss * (len(ids) - 1)
                for i, ids in enumerate(test.ids)]
    expected = sum(sums).item() / sum(len(ids) - 1 for ids in test.ids)
    assert one["test_loss"] == pytest.approx(expected, rel=1e-5)
    assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
