"""Exact distributed evaluation: every test sample once, no padding; world sizes 1 and 3 give identical metrics."""

import json
import sys

import pytest

from tests.helpers import eval_probe
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, assert_ok, run


@pytest.mark.timeout(900)
def test_metrics_identical_at_world_sizes_1_and_3(tmp_path):
    """1003 test samples, which 3 ranks cannot share evenly (one uneven world size: 2 takes the same path), through
    both loaders, against one process (this one)."""
    eval_probe.main(str(tmp_path / "ws1.json"), "device")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
           str(REPO / "tests" / "helpers" / "eval_probe.py"), str(tmp_path / "ws3.json"), "device,dataloader"]
    assert_ok(run(cmd, timeout=EVENT_S, env={"PYTHONPATH": str(REPO)}))
    results = [*json.loads((tmp_path / "ws1.json").read_text()), *json.loads((tmp_path / "ws3.json").read_text())]
    assert [r.pop("world_size") for r in results] == [1, 3, 3]
    assert results[0]["test_count"] == 1003  # 1003 = 17 x 59: neither 2 nor 3 divides it
    assert 0 < results[0]["test_accuracy"] < 1 and results[0]["test_loss"] > 0
    assert all(r == results[0] for r in results), results
