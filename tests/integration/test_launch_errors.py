"""What the launcher says about a failure of its workers, once and in its last line: a mistake every rank makes is
one line, and a failing fit() script's exception type and message end the log (under torchrun, its one line)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.launch_support import CLUSTER_CONFIG, SMALL, distrib_cmd, run_one
from tests.helpers.processes import EVENT_S, Launches
from tests.helpers.support import REPO

FIT_FAILING = REPO / "tests" / "helpers" / "fit_failing.py"


@pytest.mark.timeout(900)
def test_a_mistake_every_worker_makes_is_one_line(tmp_path):
    """Through `distrib launch -m distrib train` the parent cannot read the config: every worker fails alike, writes
    its error to torch's error file, and the launcher prints it once (no worker line, no torch log line)."""
    done = run_one(distrib_cmd("launch", "--nproc-per-node", "2", "-m", "distrib", "train", "--config", CLUSTER_CONFIG,
                               *SMALL, "--set", "train.global_batch_size=63", "--set", f"run.dir={tmp_path}/run"),
                   tmp_path, timeout=EVENT_S)
    assert done.returncode == 2, done.text()
    lines = [line for line in done.stderr.splitlines() if not line.startswith("[distrib]")]  # info lines
    assert lines[-1].startswith(("distrib launch: ranks 0, 1 (pids ", "distrib launch: rank 0")), done.text()
    assert lines[-1].endswith(": ConfigError: train.global_batch_size = 63: must divide into world_size (2) x "
                              "train.grad_accum_steps (1) = 2 equal micro-batches; use 62 or 64 [first failure]"), \
        done.text()
    # At most one line before it: the other rank, when the agent stopped it before it failed on its own.
    assert len(lines) == 1 or (len(lines) == 2 and "was stopped by the launcher" in lines[0]), done.text()


@pytest.mark.timeout(900)
def test_a_failing_fit_script_is_named_in_the_launchers_last_line(tmp_path):
    done = run_one(distrib_cmd("launch", "--nproc-per-node", "2", FIT_FAILING, tmp_path / "run"), tmp_path,
                   timeout=EVENT_S)
    assert done.returncode == 2, done.text()
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("distrib launch: rank 1 (local rank 1, pid ") and last.endswith(" [first failure]"), last
    assert "exited with code 2: UserError: the model cannot take the data's inputs: on a batch of " in last, last
    assert "it raised ValueError: my model cannot take this batch on rank 1;" in last, last
    # fit() raised one UserError on rank 1, which ended its script: no traceback, said in the launcher's last line
    # alone (rank 0 is stopped by the agent, or says in one line which peer it lost); torch's own per-worker failure
    # line is left out.
    assert "Traceback" not in done.stderr and done.stderr.count("my model cannot take") == 1, done.text()
    assert "failed (exitcode" not in done.stderr, done.text()


@pytest.mark.timeout(900)
def test_a_fit_config_mistake_is_one_line_under_distrib_launch_and_torchrun(tmp_path):
    """Every rank finds it, before any process group. distrib launch: the launcher's last line is the whole output,
    exit 2. torchrun (its own summary follows, exit 1): rank 0's output is the line, rank 1's nothing."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--log-dir", str(tmp_path / "logs"), "--redirects", "3"]  # each worker's stdout and stderr to a file
    with Launches(tmp_path) as launches:
        launches.start(distrib_cmd("launch", "--nproc-per-node", "2", FIT_FAILING, tmp_path / "a", "config"))
        launches.start([*torchrun, str(FIT_FAILING), str(tmp_path / "b"), "config"])
        launched, torchran = launches.wait(EVENT_S)
    mistake = "ConfigError: train.lrr: unknown key; did you mean 'lr'?"
    lines = launched.stderr.splitlines()
    assert launched.returncode == 2 and launched.stdout == "" and len(lines) in (1, 2), launched.text()
    assert lines[-1].startswith("distrib launch: ran") and lines[-1].endswith(f": {mistake} [first failure]"), lines
    # At most one line before it: the other rank, when the agent stopped it before it failed on its own.
    assert len(lines) == 1 or "was stopped by the launcher" in lines[0], lines
    assert torchran.returncode == 1 and mistake in torchran.stderr, torchran.text()
    said = {rank: "".join(path.read_text() for path in sorted(tmp_path.glob(f"logs/*/attempt_0/{rank}/std*.log")))
            for rank in (0, 1)}
    assert said == {0: f"distrib: error: {mistake.removeprefix('ConfigError: ')}\n", 1: ""}, said


@pytest.mark.timeout(900)
def test_a_layout_the_world_cannot_hold_is_one_line_before_any_worker_starts(tmp_path):
    """`dist.pipeline_parallel = 2` on 3 workers, and 2 heads under `dist.tensor_parallel = 4`: the launcher's own
    check refuses them, so its line is the whole output (a started worker would add its [distrib] lines), exit 2."""
    gpt_tp = ["--set", "dist.strategy=fsdp", "--set", "model.name=gpt", "--set", "model.kwargs={n_heads = 2, dim = 16}",
              "--set", "data.name=text", "--set", "dist.tensor_parallel=4"]
    with Launches(tmp_path) as launches:
        launches.start(distrib_cmd("train", "--nproc-per-node", "3", "--set", "dist.pipeline_parallel=2",
                                   "--set", f"run.dir={tmp_path}/pipeline"))
        launches.start(distrib_cmd("train", "--nproc-per-node", "4", *gpt_tp, "--set", f"run.dir={tmp_path}/heads"))
        pipeline, heads = launches.wait(EVENT_S)
    said = [(pipeline, "distrib: error: dist.pipeline_parallel = 2: does not divide world size 3; use 1 or 3 (the "
                       "divisors of 3), or a world size that is a multiple of 2"),
            (heads, "distrib: error: dist.tensor_parallel = 4: GPT's 2 attention heads (model.kwargs n_heads) cannot "
                    "be split 4 ways (each rank computes whole heads); use dist.tensor_parallel = 1 or 2 (e.g. --set "
                    "dist.tensor_parallel=2), or set model.kwargs n_heads to a multiple of 4")]
    for done, line in said:
        assert (done.returncode, done.stdout, done.stderr.splitlines()) == (2, "", [line]), done.text()
    assert not (tmp_path / "pipeline").exists() and not (tmp_path / "heads").exists()
