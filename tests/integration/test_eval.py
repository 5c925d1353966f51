"""Exact distributed evaluation: every test sample once, no padding; world sizes 1, 2, 3 give identical metrics."""

import json
import sys

import pytest

from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, assert_ok, run


@pytest.mark.timeout(900)
def test_metrics_identical_at_world_sizes_1_2_3(tmp_path):
    results = []
    for nproc, loaders in ((1, "device"), (2, "device"), (3, "device,dataloader")):  # one process, then launches
        out = tmp_path / f"ws{nproc}.json"
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
        cmd = [sys.executable, *launcher, str(REPO / "tests" / "helpers" / "eval_probe.py"), str(out), loaders]
        assert_ok(run(cmd, timeout=EVENT_S, env={"PYTHONPATH": str(REPO)}))
        results += json.loads(out.read_text())
    assert [r.pop("world_size") for r in results] == [1, 2, 3, 3]
    assert results[0]["test_count"] == 1003  # 1003 = 17 x 59: neither 2 nor 3 divides it
    assert 0 < results[0]["test_accuracy"] < 1 and results[0]["test_loss"] > 0
    assert all(r == results[0] for r in results), results
