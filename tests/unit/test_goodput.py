"""distrib plan's goodput (distrib.plan.goodput): Young/Daly's interval, Daly's first-order goodput against a simulated
job that fails, saves and restarts, replica groups' all-down rate against simulated groups, Llama 3's failure rate,
and the line a plan run prints."""

import json
import math
import random

import pytest

from distrib.cli import main
from distrib.plan.goodput import (
    STALL_SECONDS,
    all_down_mtbf,
    groups_goodput,
    mtbf_seconds,
    optimal_interval,
    restart_goodput,
)
from distrib.plan.machine import LLAMA3_FAILURES_PER_GPU_HOUR


def simulated_restarts(interval, save, mtbf, restart, rng, horizon):
    """Useful share of a job that trains `interval`, saves `save`, and on a failure (Poisson, mean `mtbf`) restarts
    in `restart` from its last checkpoint."""
    now, useful, failure = 0.0, 0.0, rng.expovariate(1 / mtbf)
    while now < horizon:
        if failure < now + interval + save:  # the work since the last checkpoint is lost
            now = failure + restart
            failure = now + rng.expovariate(1 / mtbf)
        else:
            now += interval + save
            useful += interval
    return useful / now


def simulated_all_down_mtbf(groups, mtbf, down, rng, horizon):
    """Mean time between moments when every group is down: each group fails at 1 / (G M) and is down `down`."""
    back = [0.0] * groups  # when each group is up again
    failures = sorted((rng.expovariate(1 / (groups * mtbf)), g) for g in range(groups))
    events = 0
    while failures[0][0] < horizon:
        now, group = failures.pop(0)
        if all(back[other] > now for other in range(groups) if other != group):
            events += 1
        back[group] = now + down
        failures.append((back[group] + rng.expovariate(1 / (groups * mtbf)), group))
        failures.sort()
    return horizon / events


def test_the_interval_is_young_dalys_and_maximises_goodput():
    save, mtbf, restart = 30.0, mtbf_seconds(LLAMA3_FAILURES_PER_GPU_HOUR, 1024), 300.0
    best = optimal_interval(save, mtbf)
    assert best == pytest.approx(math.sqrt(2 * save * mtbf))
    at_best = restart_goodput(best, save, mtbf, restart)
    assert at_best == pytest.approx(1 - math.sqrt(2 * save / mtbf) - restart / mtbf)
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert at_best > restart_goodput(factor * best, save, mtbf, restart)


def test_dalys_goodput_is_a_simulated_jobs_within_its_first_order():
    rng, mtbf, save, restart = random.Random(0), 1000.0, 1.0, 5.0
    for interval in (0.5 * optimal_interval(save, mtbf), optimal_interval(save, mtbf)):
        simulated = simulated_restarts(interval, save, mtbf, restart, rng, 2e7)
        assert simulated == pytest.approx(restart_goodput(interval, save, mtbf, restart), abs=0.004)


def test_the_default_rate_is_llama_3s_mtbf():
    assert mtbf_seconds(LLAMA3_FAILURES_PER_GPU_HOUR, 16_384) / 3600 == pytest.approx(54 * 24 / 419)  # 3.09 h
    assert mtbf_seconds(LLAMA3_FAILURES_PER_GPU_HOUR, 1024) / 3600 == pytest.approx(16 * 54 * 24 / 419)


def test_all_groups_down_as_often_as_simulated_groups():
    mtbf, down = 1000.0, 100.0  # each group down 3 to 5% of the time
    for groups, horizon in ((2, 4e7), (3, 4e8)):  # about 2,000 and 400 moments with all groups down
        simulated = simulated_all_down_mtbf(groups, mtbf, down, random.Random(groups), horizon)
        assert simulated == pytest.approx(all_down_mtbf(groups, mtbf, down), rel=0.1)


def test_replica_groups_lose_less_than_restarts():
    save, mtbf, restart, heal, step = 30.0, mtbf_seconds(LLAMA3_FAILURES_PER_GPU_HOUR, 16_384), 300.0, 2.0, 5.0
    interval = optimal_interval(save, mtbf)
    restarts = restart_goodput(interval, save, mtbf, restart)
    for groups in (2, 8):
        with_groups = groups_goodput(groups, interval, save, mtbf, restart, heal, step)
        assert with_groups > restarts
        # what a failure costs: the stall and the step for all, the restart and heal for 1/G of the GPUs
        whole = all_down_mtbf(groups, mtbf, restart + heal)
        assert with_groups == pytest.approx(restart_goodput(interval, save, whole, restart)
                                            - (STALL_SECONDS + step + (restart + heal) / groups) / mtbf)


def test_a_plan_prints_the_goodput_line_with_young_dalys_interval(capsys):
    argv = ["plan", "--set", "data.name=synthetic", "--set", "dist.strategy=fsdp", "--world-size", "4",
            "--failures-per-gpu-hour", "0.01", "--restart-seconds", "120", "--save-seconds", "3",
            "--step-seconds", "0.5", "--set", "checkpoint.every_steps=200"]
    assert main(argv + ["--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    mtbf = 3600 / (0.01 * 4)
    assert f["mtbf_seconds"] == pytest.approx(mtbf)
    assert f["optimal_checkpoint_interval_seconds"] == pytest.approx(math.sqrt(2 * 3 * mtbf))  # 734.8 s
    assert f["optimal_checkpoint_every_steps"] == round(math.sqrt(2 * 3 * mtbf) / 0.5)
    assert f["goodput"] == pytest.approx(1 - 3 / 100 - (50 + 120) / mtbf)
    assert f["goodput_at_optimum"] > f["goodput"]
    assert f["goodput_with_groups"] > f["goodput"] and f["replica_groups"] == 2
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    goodput = next(i for i, line in enumerate(lines) if line.startswith("goodput "))
    assert f"{f['goodput']:.2%} with checkpoints every 100 s" in lines[goodput]
    assert "Young/Daly's interval sqrt(2 x save x MTBF) = 12.2 min" in lines[goodput]
    assert "--set checkpoint.every_steps=1470" in lines[goodput]
    assert "job MTBF 25 h" in lines[goodput + 1] and "2 replica groups" in lines[goodput + 2]


def test_the_estimated_save_is_the_checkpoints_bytes_at_the_storages_bandwidth(capsys):
    argv = ["plan", "--set", "data.name=synthetic", "--set", "dist.strategy=fsdp", "--world-size", "4",
            "--storage-bandwidth", "0.001", "--json"]
    assert main(argv) == 0
    f = json.loads(capsys.readouterr().out)
    per_rank = f["parameter_bytes_per_rank"] + f["optimizer_bytes_per_rank"]
    assert f["checkpoint_bytes_per_node"] == 4 * per_rank  # fsdp: every rank of the node writes its shards
    assert f["save_seconds"] == pytest.approx(4 * per_rank / 1e6) and f["save_seconds_source"] == "estimated"
    assert f["goodput"] is None  # no measured step time: the communication bound only bounds the steps


@pytest.mark.parametrize("flag", ["--failures-per-gpu-hour", "--restart-seconds", "--storage-bandwidth",
                                  "--save-seconds", "--step-seconds"])
def test_a_goodput_key_out_of_range_is_refused_in_one_line(flag, capsys):
    assert main(["plan", "--set", "data.name=synthetic", "--world-size", "4", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert f"{flag} 0.0: must be > 0" in err and err.count("\n") == 1
