"""Throughput in every run (samples/s, step times, data wait, FLOPs, MFU), the speed and metrics config keys, the
finite check on the reduced gradients, the sync cadence, and TensorBoard."""

import json

import pytest

from distrib.config import load_config
from distrib.training.trainer import Trainer
from distrib.worker import run_training
from tests.helpers.processes import EVENT_S
from tests.helpers.support import SMALL, assert_ok, count_host_reads, sets, torchrun_train

RUN = [*SMALL, "data.synthetic_train_size=1024", "data.synthetic_test_size=200", "train.max_steps=24", "train.epochs=0",
       "train.global_batch_size=64", "train.log_every=8", "train.warmup_steps=3", "metrics.timing_skip_steps=4",
       "metrics.peak_flops=1e12"]
# Forward and backward of one 1x28x28 sample, by hand: convolutions 2*24*24*6*25 and 2*8*8*12*150, linears
# 2*(192*120 + 120*60 + 60*10); backward twice the forward, except conv1, which needs no input gradient.
NETWORK_FLOPS = 3 * (172800 + 230400 + 46080 + 14400 + 1200) - 172800


def _assert_consistent(summary: dict, world_size: int) -> None:
    for key in ("samples_per_second", "samples_per_second_per_device", "step_time_p50_s", "step_time_p95_s",
                "flops_per_sample", "mfu"):
        assert summary[key] > 0, key
    assert summary["samples_per_second_per_device"] * world_size == pytest.approx(summary["samples_per_second"])
    assert 0 <= summary["data_wait_share"] < 1
    assert summary["step_time_p50_s"] <= summary["step_time_p95_s"]
    assert summary["flops_per_sample"] == NETWORK_FLOPS and summary["peak_flops_per_device"] == 1e12
    assert summary["mfu"] == pytest.approx(summary["flops_per_sample"] * summary["samples_per_second_per_device"]
                                           / summary["peak_flops_per_device"])
    assert summary["timed_steps"] == 24 - 4


@pytest.mark.timeout(900)
def test_summary_and_log_lines_hold_consistent_throughput(tmp_path):
    summary = run_training(load_config(None, [*RUN, f"run.dir={tmp_path}"]))
    _assert_consistent(summary, 1)
    assert json.loads((tmp_path / "summary.json").read_text())["mfu"] == summary["mfu"]
    steps = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in steps] == [8, 16, 24]
    for record in steps:
        assert record["samples_per_second"] > 0 and 0 <= record["data_wait_share"] < 1 and record["mfu"] > 0


@pytest.mark.timeout(900)
def test_two_workers_report_global_and_per_device_throughput(tmp_path):
    args = sets(*RUN, f"run.dir={tmp_path}")
    assert_ok(torchrun_train(2, *args, timeout=EVENT_S))
    _assert_consistent(json.loads((tmp_path / "summary.json").read_text()), 2)


@pytest.mark.timeout(900)
def test_speed_options_train_to_the_same_weights(tmp_path):
    """channels_last, gradient_as_bucket_view, static_graph and small buckets change speed, not the result."""
    base = run_training(load_config(None, [*RUN, f"run.dir={tmp_path}/a"]))
    options = ["speed.channels_last=true", "speed.static_graph=true", "speed.gradient_as_bucket_view=true",
               "speed.bucket_cap_mb=0.01"]
    fast = run_training(load_config(None, [*RUN, f"run.dir={tmp_path}/b", *options]))
    assert fast["test_loss"] == pytest.approx(base["test_loss"], rel=1e-4)


@pytest.mark.timeout(900)
def test_nothing_is_read_on_the_host_between_sync_steps(tmp_path, monkeypatch):
    reads = count_host_reads(monkeypatch)
    summary = run_training(load_config(None, [*RUN, f"run.dir={tmp_path}", "train.sync_every=5"]))
    assert summary["steps"] == 24 and reads
    assert {step for step, _ in reads} == {5, 8, 10, 15, 16, 20, 24}  # every 5th step and the log steps


@pytest.mark.timeout(900)
def test_loss_and_stop_votes_are_reduced_on_sync_steps_only(tmp_path, monkeypatch):
    synced = []
    real = Trainer._agree
    monkeypatch.setattr(Trainer, "_agree",
                        lambda self, local, step: synced.append(step) or real(self, local, step))
    run_training(load_config(None, [*RUN, f"run.dir={tmp_path}", "train.sync_every=5"]))
    assert synced == [5, 8, 10, 15, 16, 20, 24]  # every 5th step and every log step (8, 16, 24)


@pytest.mark.timeout(900)
def test_tensorboard_scalars_on_rank_0(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # in the dev extra

    run_training(load_config(None, [*RUN, f"run.dir={tmp_path}", "metrics.tensorboard=true"]))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "test/accuracy", "throughput/samples_per_second", "throughput/mfu"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [8, 16, 24]
