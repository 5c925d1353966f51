"""A finished run rerun by a scheduler at another world size: every rank learns from rank 0 that the run is finished,
`distrib train --nproc-per-node 2` exits 0 and summary.json stays byte-identical."""

import pytest

from distrib.cli import main
from tests.helpers.launch_support import distrib_cmd, run_one
from tests.helpers.support import SMALL


@pytest.mark.timeout(150)
def test_a_finished_run_rerun_on_2_workers_exits_0_and_leaves_summary_json(tmp_path):
    """The scheduler's rerun at another world size: every rank learns from rank 0 that the run is finished."""
    items = [*SMALL, f"run.dir={tmp_path}/run"]
    assert main(["train", *[arg for item in items for arg in ("--set", item)]]) == 0
    summary = (tmp_path / "run" / "summary.json").read_bytes()
    done = run_one(distrib_cmd("train", "--nproc-per-node", "2", *[arg for item in items for arg in ("--set", item)]),
                   tmp_path, timeout=120)
    assert done.returncode == 0, done.text()
    assert (tmp_path / "run" / "summary.json").read_bytes() == summary
    [line] = [line for line in done.stderr.splitlines() if "nothing to train" in line]
    assert line.startswith(f"distrib: {tmp_path}/run: the run is finished (2 of 2 steps done)"), done.text()
