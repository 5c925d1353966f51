"""Streams through `distrib train`: a plain IterableDataset over 10 shard files read by 2 DataLoader workers (world 1
= world 2, every sample of the pass trained once, SIGTERM and rerun bitwise equal to an uninterrupted run); a Hugging
Face streaming dataset over 4 JSON-lines files of unequal lengths under fsdp (no hang, no sample twice, what each
rank left, SIGTERM and rerun bitwise), also trained one pass by train.epochs (no train.max_steps) with rank 1
SIGKILLed mid-pass under `distrib launch --max-restarts`, restarted, resumed from its checkpointed stream position and
bitwise equal to the uninterrupted run; bad streams (a wrong structure halfway, an empty stream, a Hugging Face
column that changes type): one line, exit 2. The world-size-2 runs share two launches (see _launch)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from distrib import cli
from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import launch_runs, split_runs
from tests.helpers.stream_kinds import write_bad_jsonl
from tests.helpers.streams import write_jsonl_shards, write_tensor_shards
from tests.helpers.support import load_weights, max_relative_diff, sets

BASE = ("model.factory=tests.helpers.streams:id_model", "train.max_steps=100", "train.epochs=1",
        "train.global_batch_size=16", "train.schedule=constant", "train.warmup_steps=2", "train.log_every=5",
        "train.sync_every=2", "data.num_workers=2", "run.progress=false", "dist.device=cpu",
        "checkpoint.every_steps=0")


def _overrides(run_dir: Path, factory: str, folder: Path, *extra: str) -> list[str]:
    return [*BASE, f"data.factory=tests.helpers.streams:{factory}", f'data.kwargs={{folder = "{folder}"}}',
            f"run.dir={run_dir}", *extra]


def _trained_ids(folder: Path) -> Counter:
    return Counter(int(i) for path in folder.glob("ids_rank*.txt") for i in path.read_text().split())


def _assert_bitwise(a: Path, b: Path) -> None:
    weights_a, weights_b = load_weights(a), load_weights(b)
    assert all(torch.equal(weights_a[key], weights_b[key]) for key in weights_a)


# The world-size-2 runs of the tests below, in two launches of tests/helpers/train_runs.py (a launch's process
# start-up is most of a run's cost; each run with its own environment, every run's exit code kept). The first, under
# torchrun, makes the uninterrupted runs, the stopped ones (rank 1 sends itself SIGTERM: every rank checkpoints and
# returns 75) and the bad streams. The second, fresh processes under `distrib launch --max-restarts`, first makes the
# killed run (the Hugging Face stream's: a plain stream's resume is the stopped one's): it trains one pass by
# train.epochs (no train.max_steps) with a checkpoint every 4 steps, and its rank 1 SIGKILLs itself once, mid-pass;
# the launcher restarts both workers, the killed run resumes from its last checkpoint; then it reruns the stopped
# ones.
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def _launch(out: Path, name: str, runs: list, launcher: list[str] = TORCHRUN_2) -> tuple[dict, dict[str, str]]:
    """Runs [(name, env, overrides)] in one 2-worker launch: each run's exit code, its stderr (its last attempt's)."""
    (out / name).mkdir()
    # One thread per worker, as torchrun gives: distrib's launcher would share out the cores, and bits can depend on it.
    done = launch_runs(launcher, runs, out / name, env={"OMP_NUM_THREADS": "1"}, codes=out / f"{name}_codes.json")
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    codes = json.loads((out / f"{name}_codes.json").read_text())
    last = done.stderr[done.stderr.rindex(f"== run {runs[0][0]} =="):]  # after the restarts: the last attempt's
    return codes, split_runs(last, [run_name for run_name, _, _ in runs])  # by rank 0's markers


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """The folder of the runs (plain/ with two/, stopped/, halfway/, ids/; hf/ with two/, stopped/, killed/, bad/,
    ids/), each run's exit code and its output."""
    out = tmp_path_factory.mktemp("streams")
    write_tensor_shards(out / "shards", [37] * 10)  # 370 samples: 23 global batches of 16, 2 left
    write_jsonl_shards(out / "jsonl", [100, 300, 150, 50])  # rank 0 reads files 0 and 2 (250), rank 1 1 and 3 (350)
    # (factory, data, overrides, SIGTERM in rank 1's forward N): plain: 2 forwards a step
    kinds = {"plain": ("plain", out / "shards", PLAIN_EXTRA, 15)}
    if importlib.util.find_spec("datasets"):
        kinds["hf"] = ("hugging_face", out / "jsonl", HF_EXTRA, 12)
    first, killed, rerun = [], [], []
    for kind, (factory, folder, extra, stop_at) in kinds.items():
        (out / kind / "ids").mkdir(parents=True)
        overrides = {name: _overrides(out / kind / name, factory, folder, *extra) for name in ("two", "stopped")}
        first += [(f"{kind}/two", {"DISTRIB_TEST_IDS": str(out / kind / "ids")}, overrides["two"]),
                  (f"{kind}/stopped", {"DISTRIB_TEST_DIE_AT": str(stop_at)}, overrides["stopped"])]
        rerun.append((f"{kind}/rerun", {}, overrides["stopped"]))
    if "hf" in kinds:  # SIGKILL in step 14: resumed at 12
        killed.append(("hf/killed", {"DISTRIB_TEST_DIE_AT": "14", "DISTRIB_TEST_DIE_SIGNAL": "SIGKILL",
                                     "DISTRIB_TEST_DIE_ONCE": str(out / "hf" / "died")},
                       _overrides(out / "hf" / "killed", "hugging_face", out / "jsonl", *HF_EXTRA,
                                  "train.max_steps=0", "checkpoint.every_steps=4")))
    # the bad streams, last: runs that fail (exit 2 on every rank) in the shared launch. A plain stream with a wrong
    # structure past the first 256 samples (where the data's kind is learnt): found at step 19, after checkpoint 18.
    first.append(("plain/halfway", {}, _overrides(out / "plain" / "halfway", "plain", out / "shards",
                                                  f"data.kwargs={{folder = '{out / 'shards'}', bad_after = 300}}",
                                                  "checkpoint.every_steps=2")))
    if "hf" in kinds:
        write_bad_jsonl(out / "jsonl_bad", [100] * 4)
        first.append(("hf/bad", {}, _overrides(out / "hf" / "bad", "hugging_face", out / "jsonl_bad", *HF_BAD)))
    codes, said = _launch(out, "first", first)
    restarting = [sys.executable, "-m", "distrib", "launch", "--nproc-per-node=2", f"--max-restarts={len(killed)}"]
    rerun_codes, rerun_said = _launch(out, "rerun", [*killed, *rerun], restarting)
    return out, {**codes, **rerun_codes}, {**said, **rerun_said}


def _assert_killed_resumed(out: Path, kind: str, codes: dict, restarts: int, resumed_at: int, steps: int) -> None:
    """The killed run ended by its one pass (train.epochs = 1), after a restart, bitwise where the uninterrupted ran."""
    summary = json.loads((out / kind / "killed" / "summary.json").read_text())
    assert codes[f"{kind}/killed"] == 0 and (out / kind / "died").exists(), codes
    assert (summary["restart_count"], summary["resumed_from_step"], summary["steps"], summary["epochs"]) == (
        restarts, resumed_at, steps, 1), summary
    _assert_bitwise(out / kind / "killed", out / kind / "two")


# One worker per rank; rank 1 reads files 1 and 3 (the bad one) in order: 12 steps, then step 13 meets file 3.
HF_BAD = ("data.num_workers=1", "checkpoint.every_steps=5")
PLAIN_EXTRA = ("train.grad_accum_steps=2",)  # micro-batches of 4 at world 2, read by 2 workers in turn
HF_EXTRA = ("dist.strategy=fsdp",)  # sharded checkpoints: the workers' positions go into trainer.pt


@pytest.mark.timeout(1200)
def test_a_plain_stream_agrees_across_world_sizes_and_resumes_exactly(streams, tmp_path):
    out, codes, said = streams
    runs = {"one": tmp_path / "one", "two": out / "plain" / "two", "stopped": out / "plain" / "stopped"}
    run_training(load_config(None, _overrides(runs["one"], "plain", out / "shards", *PLAIN_EXTRA)))
    assert [codes[f"plain/{name}"] for name in ("two", "stopped", "rerun")] == [0, 75, 0], (codes, said)
    assert "the last 2 (a partial global batch) not" in said["plain/two"], said["plain/two"]
    assert max_relative_diff(load_weights(runs["one"]), load_weights(runs["two"])) < 1e-5
    trained = _trained_ids(out / "plain" / "ids")
    assert set(trained) == set(range(368)) and set(trained.values()) == {1}  # each once; the last 2 untrained
    assert "resumed at step" in said["plain/rerun"], said["plain/rerun"]
    _assert_bitwise(runs["stopped"], runs["two"])


@pytest.mark.timeout(1200)
def test_a_sharded_hugging_face_stream_ends_together_and_resumes_exactly(streams):
    pytest.importorskip("datasets")
    out, codes, said = streams
    assert [codes[f"hf/{name}"] for name in ("two", "stopped", "rerun")] == [0, 75, 0], (codes, said)
    # rank 0's workers: 100 -> 12 micro-batches of 8 (4 left), 150 -> 18 (6 left); 30 steps; rank 1 leaves the rest
    assert "samples left untrained per rank [10, 110]" in said["hf/two"], said["hf/two"]
    trained = _trained_ids(out / "hf" / "ids")
    assert sum(trained.values()) == 30 * 16 and set(trained.values()) == {1}  # no sample twice
    assert "resumed at step" in said["hf/rerun"], said["hf/rerun"]
    _assert_bitwise(out / "hf" / "stopped", out / "hf" / "two")
    _assert_killed_resumed(out, "hf", codes, restarts=1, resumed_at=12, steps=30)


@pytest.mark.timeout(1200)
def test_a_hugging_face_stream_whose_column_changes_type_is_one_line_at_world_2(streams):
    """World 1: tests/unit/test_stream_kinds.py. Before, datasets' cast error escaped a DataLoader worker as a 161-line
    traceback; now it is a bad sample's line, on every rank at the same step."""
    pytest.importorskip("datasets")
    out, codes, said = streams
    text = said["hf/bad"]
    assert codes["hf/bad"] == 2 and "Traceback" not in text, text
    assert ("train data: reading the stream raised ArrowInvalid: Failed to parse string: 'class 0' as a scalar of type"
            " int64 (at step 13 of pass 0: the checkpoints before it are kept)") in text, text
    kept = sorted(p.name for p in (out / "hf" / "bad" / "checkpoints").glob("step_*"))
    assert kept == ["step_00000005.pt", "step_00000010.pt"], kept


@pytest.mark.timeout(1200)
def test_bad_streams_are_one_line_and_exit_2(streams, tmp_path, capfd):
    """A plain stream's wrong structure halfway at world 2 (in the shared launch); an empty stream in this process."""
    out, codes, said = streams
    halfway = said["plain/halfway"]
    empty_dir = tmp_path / "empty"
    empty_code = cli.main(["train", *sets(*_overrides(empty_dir, "empty", out / "shards"))])
    empty = capfd.readouterr().err
    assert [codes["plain/halfway"], empty_code] == [2, 2], halfway + empty
    assert "Traceback" not in halfway + empty
    assert "train data: a sample is a tuple" in halfway, halfway
    assert "train data: an empty stream" in empty, empty
    kept = sorted(p.name for p in (out / "plain" / "halfway" / "checkpoints").iterdir())
    assert "step_00000018.pt" in kept and not [name for name in kept if name.endswith(".tmp")], kept
    assert not (empty_dir / "summary.json").exists()
