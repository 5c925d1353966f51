"""Throughput in every run (samples/s, step times, data wait, FLOPs, MFU), the speed and metrics config keys, the
finite check on the reduced gradients, the sync cadence, and TensorBoard."""

import re
import sys

import pytest
import torch
import torch.nn as nn

from distrib import cli
from distrib.config import load_config
from distrib.errors import ConfigError, UserError
from distrib.metrics import Recorder
from distrib.models.network import Network
from distrib.training import throughput
from distrib.training.throughput import Throughput, count_flops_per_sample, peak_flops
from tests.helpers.support import SMALL, count_host_reads, sets

RUN = [*SMALL, "data.synthetic_train_size=1024", "data.synthetic_test_size=200", "train.max_steps=24", "train.epochs=0",
       "train.global_batch_size=64", "train.log_every=8", "train.warmup_steps=3", "metrics.timing_skip_steps=4",
       "metrics.peak_flops=1e12"]
# Forward and backward of one 1x28x28 sample, by hand: convolutions 2*24*24*6*25 and 2*8*8*12*150, linears
# 2*(192*120 + 120*60 + 60*10); backward twice the forward, except conv1, which needs no input gradient.
NETWORK_FLOPS = 3 * (172800 + 230400 + 46080 + 14400 + 1200) - 172800


def _fake_clock(monkeypatch, times):
    ticks = iter(times)
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(ticks))


def test_meter_quantiles_data_wait_and_skipped_steps(monkeypatch):
    meter = Throughput(global_batch_size=100, world_size=2, skip_steps=1)
    # restart, then per step (data ready, step done): step 1 is warm-up (10 s), then four 1 s steps, 0.25 s waiting
    _fake_clock(monkeypatch, [0, 1, 10, 10.25, 11, 11.25, 12, 12.25, 13, 13.25, 14])
    meter.restart_clock()
    for _ in range(5):
        meter.data_ready()
        meter.step_done()
    meter.flops_per_sample, meter.peak_flops_per_device = 1e6, 1e9
    summary = meter.summary()
    assert summary["timed_steps"] == 4 and summary["samples_per_second"] == pytest.approx(100)
    assert summary["samples_per_second_per_device"] == pytest.approx(50)
    assert summary["step_time_p50_s"] == pytest.approx(1) and summary["step_time_p95_s"] == pytest.approx(1)
    assert summary["data_wait_share"] == pytest.approx(0.25) and summary["mfu"] == pytest.approx(0.05)
    assert meter.window()["step_time_p95_s"] == pytest.approx(10)  # a log window includes the warm-up step


def test_a_step_with_fewer_replica_groups_counts_their_samples_over_their_devices(monkeypatch):
    """Fault-tolerant replica groups: a step that one of two groups missed counts half the global batch, and its
    samples per device are those of the group that took part (not diluted over the missing one's devices)."""
    meter = Throughput(global_batch_size=100, world_size=4, skip_steps=0)  # 2 groups of 2 workers
    _fake_clock(monkeypatch, [0, 1, 2])
    meter.restart_clock()
    meter.step_done(1.0)
    meter.step_done(0.5)
    summary = meter.summary()
    assert summary["samples_per_second"] == pytest.approx(75)  # 150 samples in 2 s
    assert summary["samples_per_second_per_device"] == pytest.approx(75 / 3)  # 4 devices, then 2: 3 on average


def test_meter_restart_clock_keeps_evaluation_out(monkeypatch):
    meter = Throughput(global_batch_size=10, world_size=1, skip_steps=0)
    _fake_clock(monkeypatch, [0, 0, 1, 50, 50, 51])  # a 49 s evaluation between the two steps
    meter.restart_clock()
    meter.data_ready()
    meter.step_done()
    meter.restart_clock()
    meter.data_ready()
    meter.step_done()
    assert meter.summary()["samples_per_second"] == pytest.approx(10)


def test_flop_count_is_exact_and_side_effect_free():
    model = nn.Sequential(nn.BatchNorm2d(1, affine=False), Network())  # running statistics, no parameters
    stats = model[0].running_mean.clone()
    inputs, targets = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    assert count_flops_per_sample(model, inputs, targets) == NETWORK_FLOPS  # normalisation counts no FLOPs
    assert model.training and all(p.grad is None for p in model.parameters())
    assert torch.equal(model[0].running_mean, stats)


def test_peak_table_override_and_unknown_device():
    assert peak_flops("cuda", "NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("cuda", "NVIDIA H100 PCIe", "fp32") == 51.2e12
    assert peak_flops("cuda", "NVIDIA H200", "bf16", override=5e14) == 5e14
    assert peak_flops("cuda", "Some Future GPU", "bf16") is None
    assert peak_flops("cpu", "any", "fp32") == throughput.CPU_PEAK_FLOPS_PER_THREAD * torch.get_num_threads()


@pytest.mark.parametrize("override, message", [
    ("speed.bucket_cap_mb=-1", "speed.bucket_cap_mb = -1.0: must be a finite number >= 0.0"),
    ("speed.compile_mode=fast", "speed.compile_mode = 'fast': must be one of default, reduce-overhead"),
    ("speed.compile=1", "speed.compile = 1: must be of type bool"),
    ("speed.channels_last=yes", "speed.channels_last = 'yes': must be of type bool"),
    ("metrics.peak_flops=-1", "metrics.peak_flops = -1.0: must be a finite number >= 0.0"),
    ("metrics.timing_skip_steps=-1", "metrics.timing_skip_steps = -1: must be a finite number >= 0"),
    ("metrics.tensorboard=2", "metrics.tensorboard = 2: must be of type bool"),
    ("train.finite_check_every=-1", "train.finite_check_every = -1: must be a finite number >= 0"),
    ("train.sync_every=0", "train.sync_every = 0: must be a finite number >= 1"),
    ("metrics.tensorbord=true", "metrics.tensorbord: unknown key; did you mean 'tensorboard'?"),
])
def test_new_keys_are_validated(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_static_graph_refuses_gradient_accumulation():
    with pytest.raises(ConfigError, match=r"^speed.static_graph = true: does not work with train.grad_accum_steps"):
        load_config(None, ["speed.static_graph=true", "train.grad_accum_steps=2"])
    config = load_config(None, ["speed.static_graph=true", "speed.gradient_as_bucket_view=true",
                                "speed.channels_last=true", "speed.bucket_cap_mb=0.5", "metrics.peak_flops=1e12"])
    assert config.speed.bucket_cap_mb == 0.5 and config.metrics.peak_flops == 1e12


@pytest.mark.timeout(60)
def test_divergence_is_one_line_and_saves_no_weights(tmp_path, capsys):
    argv = ["train", *sets(*RUN, f"run.dir={tmp_path}", "train.lr=1e4")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"distrib: error: train gradients are not finite (at step \d+|between steps \d+ and \d+) ", err)
    assert "lower train.lr" in err and not (tmp_path / "model.pt").exists()


@pytest.mark.timeout(60)
def test_a_divergence_stops_at_the_next_sync_step(tmp_path, monkeypatch, capsys):
    count_host_reads(monkeypatch)
    argv = ["train", *sets(*RUN, f"run.dir={tmp_path}", "train.lr=1e4", "train.sync_every=3")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(r"distrib: error: train gradients are not finite (at step 3|between steps 1 and 3) \(loss ", err)
    assert "lower train.lr" in err and not (tmp_path / "model.pt").exists()


def test_missing_tensorboard_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(UserError) as e:
        Recorder(tmp_path, enabled=False, tensorboard=True)  # every rank checks, not only the writer
    assert str(e.value) == ("metrics.tensorboard = true: the tensorboard package is not installed; "
                            "pip install 'distrib[tensorboard]', or --set metrics.tensorboard=false")
