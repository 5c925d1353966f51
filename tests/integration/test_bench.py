"""The speed scripts, run small: scripts/bench.py's table and JSON, and scripts/gpu_check.py's non-CUDA parts on gloo.
Shape only: what they measure on a shared CPU says nothing here."""

import json
import sys

import pytest

from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, assert_ok, run


@pytest.mark.timeout(900)
def test_bench_prints_the_table_and_writes_the_json(tmp_path):
    """World size 2 only: the GPT's and bench_compile's runs below launch world size 1."""
    out = tmp_path / "bench.json"
    result = run([sys.executable, str(REPO / "scripts" / "bench.py"), "--steps", "5", "--skip", "2", "--repeats", "1",
                  "--warmup-runs", "0", "--train-size", "1024", "--world-sizes", "2",
                  "--variants", "hand,trainer,lockstep,dataloader,bucket_view", "--json", str(out)], timeout=EVENT_S)
    assert_ok(result)
    data = json.loads(out.read_text())
    assert set(data) == {"machine", "settings", "clocks", "runs", "median", "ratios", "target", "targets_met"}
    assert set(data["runs"]) == {"2"} and data["clocks"] == ["wall", "p50", "cpu"]
    for ws in ("2",):
        assert list(data["runs"][ws]) == ["hand", "trainer", "trainer (lockstep)", "hand (lockstep)", "dataloader",
                                          "bucket_view"]
        assert all(len(runs) == 1 and min(runs[0][c] for c in ("wall", "p50", "cpu")) > 0
                   for runs in data["runs"][ws].values())
        assert set(data["ratios"][ws]) == {"trainer / hand", "trainer / hand (lockstep)", "device / dataloader",
                                           "dataloader / trainer", "bucket_view / trainer"}
        ratio, median = data["ratios"][ws]["trainer / hand"], data["median"][ws]
        assert ratio["wall"] == pytest.approx(median["trainer"]["wall"] / median["hand"]["wall"])
        assert set(ratio) == {"wall", "p50", "cpu", "paired_wall", "paired_p50", "paired_cpu"}
        assert set(data["targets_met"][ws]) == {"trainer / hand (lockstep)", "device / dataloader"}
        assert set(data["targets_met"][ws]["trainer / hand (lockstep)"]) == {"wall", "p50", "cpu"}
        # identical work: the hand loop and the trainer take the same steps from the same weights
        assert data["median"][ws]["hand"]["final_loss"] == pytest.approx(data["median"][ws]["trainer"]["final_loss"])
        lockstep = [data["median"][ws][f"{name} (lockstep)"]["final_loss"] for name in ("hand", "trainer")]
        assert lockstep[0] == pytest.approx(lockstep[1]) == pytest.approx(data["median"][ws]["hand"]["final_loss"])
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["world", "size", "variant"]
    assert any(line.split()[:4] == ["2", "trainer", "/", "hand"] and len(line.split()) == 10 for line in lines)
    verdict = "target trainer / hand (lockstep) >= 0.97 at world size 2 (paired): wall "
    assert any(line.startswith(verdict) for line in lines)
    assert lines[-1] == f"written to {out}"


@pytest.mark.timeout(900)
def test_bench_times_the_gpt_against_the_nanogpt_style_loop_on_identical_work(tmp_path):
    """Windows of 32 bytes of a 35 kB text (the GPL, as test_lm.py), not 64 of the docs' 275 kB: each run evaluates
    on a tenth of it."""
    out = tmp_path / "bench.json"
    result = run([sys.executable, str(REPO / "scripts" / "bench.py"), "--model", "gpt", "--world-sizes", "1",
                  "--steps", "6", "--skip", "2", "--repeats", "1", "--warmup-runs", "0", "--batch", "8",
                  "--seq-len", "32", "--text", "/usr/share/common-licenses/GPL-3", "--json", str(out)],
                 timeout=EVENT_S)
    assert_ok(result)
    data = json.loads(out.read_text())
    assert list(data["runs"]["1"]) == ["hand", "trainer", "fsdp", "hand_fsdp"]
    assert set(data["ratios"]["1"]) == {"trainer / hand", "fsdp / hand", "fsdp / trainer", "hand_fsdp / hand",
                                        "fsdp / hand_fsdp"}
    assert set(data["targets_met"]["1"]) == {"trainer / hand", "fsdp / hand_fsdp"}
    median = data["median"]["1"]
    # the same GPT, windows, AdamW and steps: the trainer (ddp and fsdp) and the hand loop end on the same loss
    assert median["hand"]["final_loss"] == pytest.approx(median["trainer"]["final_loss"], rel=1e-5)
    assert median["hand"]["final_loss"] == pytest.approx(median["fsdp"]["final_loss"], rel=1e-5)
    assert median["hand"]["final_loss"] == pytest.approx(median["hand_fsdp"]["final_loss"], rel=1e-5)
    assert data["target"] == 0.95 and result.stdout.splitlines()[0].split()[3] == "tokens/s:"
    headline = result.stdout.splitlines()[-3]
    assert headline.startswith("distrib / hand loop tokens/s at world size 1, median of 1 alternating pairs: ddp ")
    assert ", fsdp " in headline and ", bare fully_shard " in headline


@pytest.mark.timeout(900)
def test_gpu_check_runs_its_checks_and_table_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
                  "--json", str(out)], timeout=EVENT_S)
    assert_ok(result)
    data = json.loads(out.read_text())
    assert [c["ok"] for c in data["checks"]] == [True, True, True, True], data["checks"]
    assert data["checks"][0]["detail"] == "bitwise equal"
    assert data["checks"][3]["check"].startswith("FSDP2 (gloo, world size 1) = DDP")
    assert [(r["batch"], r["mode"]) for r in data["rows"]] == [
        (32, "fp32"), (32, "bf16"), (32, "bf16 dataloader"), (32, "fsdp bf16")]
    assert all(r["samples_per_second"] > 0 and r["mfu"] > 0 for r in data["rows"])
    assert [r["mode"] for r in data["gpt"]] == ["gpt bf16", "gpt fsdp bf16", "gpt hsdp bf16", "gpt tp2 bf16",
                                                "gpt pp2 bf16"]
    ran = [r for r in data["gpt"] if "skipped" not in r]
    assert [r["mode"] for r in ran] == ["gpt bf16", "gpt fsdp bf16", "gpt hsdp bf16"]  # one process: no TP 2, PP 2
    assert all("even world size" in row["skipped"] for row in data["gpt"][-2:])
    assert all(r["tokens_per_second"] > 0 and r["mfu"] > 0 and r["test_loss"] > 0 for r in ran)
    assert "tokens/s" in result.stdout
    assert "PASS" in result.stdout and "FAIL" not in result.stdout and "samples/s" in result.stdout


@pytest.mark.timeout(900)
def test_bench_compile_prints_compiled_over_eager_per_strategy(tmp_path):
    """The least that shows the table: one round at world size 1 (a compile is paid per process: at 2, twice) of ddp
    (the whole model compiled over DDP, which test_compile.py's blocks do not take) eager and compiled, on a GPT of one
    block, 3 steps (2 timed). (Measured with a cold compile cache on 2 cores: ddp and fsdp on 4 blocks, 4 steps, took
    55 CPU-s, 195 s at a load of 5-10 and past 420 s at 10-18; this takes 21 CPU-s, 32-44 s at 7-8, 128 s at 9-12.)"""
    out = tmp_path / "bench_compile.json"
    result = run([sys.executable, str(REPO / "scripts" / "bench_compile.py"), "--world-sizes", "1", "--strategies",
                  "ddp", "--layers", "1", "--steps", "3", "--skip", "1", "--repeats", "1", "--warmup-runs", "0",
                  "--json", str(out)], timeout=EVENT_S)
    assert_ok(result)
    data = json.loads(out.read_text())
    median, ratios = data["median"]["1"], data["ratios"]["1"]
    assert list(median) == ["ddp", "ddp compiled"] and list(ratios) == ["ddp"]
    compiled = median["ddp compiled"]  # the same steps, compiled or not
    assert compiled["final_loss"] == pytest.approx(median["ddp"]["final_loss"], rel=1e-5)
    assert ratios["ddp"]["wall"] == pytest.approx(compiled["wall"] / median["ddp"]["wall"])
    assert set(ratios["ddp"]) == {"wall", "p50", "cpu", "paired_wall", "paired_p50", "paired_cpu"}
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["world", "size", "variant"]
    assert any(line.split()[:2] == ["1", "ddp"] and len(line.split()) == 8 for line in lines[-4:])
    assert lines[-1] == f"written to {out}"


@pytest.mark.timeout(900)
def test_bench_pipeline_prints_the_ratios_idle_shares_and_bubbles(tmp_path):
    out = tmp_path / "bench_pipeline.json"
    result = run([sys.executable, str(REPO / "scripts" / "bench_pipeline.py"), "--steps", "3", "--skip", "1",
                  "--rounds", "1", "--layers", "4", "--heads", "2", "--dim", "16", "--seq-len", "16",
                  "--microbatches", "2", "--json", str(out)], timeout=EVENT_S)
    assert_ok(result)
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["fsdp 4", "pp 2 x fsdp 2, 1f1b", "pp 2 x fsdp 2, interleaved"]
    # the same GPT on the same batches: every variant ends on the same loss
    losses = [row["final_loss"] for row in summary.values()]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4) and losses[2] == pytest.approx(losses[0], rel=1e-4)
    for name, bubble in (("pp 2 x fsdp 2, 1f1b", 1 / 3), ("pp 2 x fsdp 2, interleaved", 1 / 5)):
        row = summary[name]
        assert row["bubble_share"] == pytest.approx(bubble) and row["ratio_to_fsdp"] > 0
        assert len(row["idle_share"]) == 2 and all(0 < share < 1 for share in row["idle_share"])
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["variant", "tokens/s"] and lines[-1] == f"written to {out}"


@pytest.mark.timeout(900)
def test_bench_cp_prints_its_table_and_the_dry_run_of_cp2_fsdp2_is_within_20_percent_of_the_measured_peak(tmp_path):
    """Sequence 256, 2 layers 64 wide (the target's 4,096 is the bench's own run): one launch of 4 workers runs fsdp 4
    and cp 2 x fsdp 2, each rank a window a micro-batch; rank 0's step peak (torch's FSDPMemTracker over the real
    tensors) against `distrib plan --dry-run`'s of the same layout (fake tensors on a fake group), within 20%; the
    plan's activations against the bytes autograd saved in the run, within 20%."""
    out = tmp_path / "bench_cp.json"
    result = run([sys.executable, str(REPO / "scripts" / "bench_cp.py"), "--seq-len", "256", "--dim", "64",
                  "--json", str(out)], timeout=EVENT_S)
    assert_ok(result)
    data = json.loads(out.read_text())
    layouts = ["cp 1 (fsdp 4)", "cp 2 x fsdp 2"]
    assert list(data["runs"]) == layouts
    assert abs(data["dry_run_over_measured"] - 1) <= 0.2, data
    for name in layouts:
        measured, planned = data["runs"][name]["activation_bytes"], data["plan"]["activation_bytes"][name]
        assert abs(planned - measured) <= 0.2 * measured, (name, planned, measured)
    # the plan's all-gather of the keys and values and the reduce-scatter of their gradients: a rank's own, 2 layers
    own = 2 * 2 * 128 * 64 * 4
    assert [(c["kind"], c["intra_node"]) for c in data["plan"]["cp_collectives"]] == \
        [("all-gather", own), ("reduce-scatter", own)]
    lines = result.stdout.splitlines()
    assert lines[1].split() == ["layout", "activations", "MiB", "plan", "MiB", "step", "peak", "MiB"]
    assert [line.split("  ")[0] for line in lines[2:4]] == layouts
    assert lines[4].startswith("activations cp 2 / cp 1: ") and lines[5].startswith("dry run of cp 2 x fsdp 2: ")
