"""`distrib launch --replica-groups 2` on one node: torchft's Lighthouse and two groups, each its own world on its own
rendezvous; a group whose worker fails is restarted alone while the other goes on and is never restarted."""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch_support import distrib_cmd, run_one
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO

PROBE = REPO / "tests" / "helpers" / "group_probe.py"


@pytest.mark.timeout(900)
def test_a_failed_group_is_restarted_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    done = run_one(distrib_cmd("launch", "--replica-groups", "2", "--nproc-per-node", "4", "--max-restarts", "1",
                               PROBE, out), tmp_path, timeout=EVENT_S)
    assert done.returncode == 0, done.text()
    seen = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    # group 0: one attempt only; group 1: its first attempt failed, its restart (attempt 1) ran
    assert sorted(seen) == ["g0_r0_a0", "g0_r1_a0", "g1_r0_a0", "g1_r0_a1", "g1_r1_a0", "g1_r1_a1"], done.text()
    lighthouse = seen["g0_r0_a0"]["TORCHFT_LIGHTHOUSE"]
    assert lighthouse.startswith("http://127.0.0.1:") and seen["g0_r0_a0"]["lighthouse_status"] == 200
    for name, env in seen.items():
        group = name[1]
        assert (env["DISTRIB_REPLICA_GROUP"], env["WORLD_SIZE"], env["RANK"]) == (group, "2", name[4]), env
        assert (env["TORCHFT_LIGHTHOUSE"], env["ROLE_NAME"]) == (lighthouse, f"replica_group_{group}"), env
        assert env["OMP_NUM_THREADS"] == seen["g0_r0_a0"]["OMP_NUM_THREADS"]  # the node's cores shared by all 4
    # each group its own rendezvous: its own store port
    assert seen["g0_r0_a0"]["MASTER_PORT"] != seen["g1_r0_a0"]["MASTER_PORT"]
    assert done.stderr.count("distrib launch: 2 replica groups of 2 workers, torchft's Lighthouse at") == 1
