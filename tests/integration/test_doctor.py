"""distrib doctor: each misconfiguration caught by its check (fake environments, no processes), and the command's exit
status on a bad and on a clean environment."""

from __future__ import annotations

import pytest

from tests.helpers.launch_support import clean_env, distrib_cmd, run_one
from tests.helpers.processes import EVENT_S


@pytest.mark.timeout(900)
def test_doctor_command_fails_on_a_bad_environment_and_passes_on_a_clean_one(tmp_path):
    bad = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2")
    done = run_one(distrib_cmd("doctor"), tmp_path, timeout=EVENT_S, env=bad)
    assert done.returncode == 1, done.text()
    assert "FAIL" in done.stdout and "loopback" in done.stdout and "check(s) failed" in done.stderr
    done = run_one(distrib_cmd("doctor"), tmp_path, timeout=EVENT_S, env=clean_env())
    assert done.returncode == 0, done.text()
    for line in ("torch", "gloo", "launch environment", "SLURM environment", "checks"):
        assert line in done.stdout
