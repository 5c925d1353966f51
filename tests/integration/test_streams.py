"""Streams through `distrib train`: a plain IterableDataset over 10 shard files read by 2 DataLoader workers (world 1
= world 2, every sample of the pass trained once, SIGTERM and rerun bitwise equal to an uninterrupted run); a Hugging
Face streaming dataset over 4 JSON-lines files of unequal lengths under fsdp (no hang, no sample twice, what each
rank left, SIGTERM and rerun bitwise); bad streams (a wrong structure halfway, an empty stream): one line, exit 2."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.launch_support import distrib_cmd
from tests.helpers.processes import EVENT_S, Launches, clean_env
from tests.helpers.streams import write_jsonl_shards, write_tensor_shards
from tests.helpers.support import load_weights, max_relative_diff, sets

BASE = ("model.factory=tests.helpers.streams:id_model", "train.max_steps=100", "train.epochs=1",
        "train.global_batch_size=16", "train.schedule=constant", "train.warmup_steps=2", "train.log_every=5",
        "train.sync_every=2", "data.num_workers=2", "run.progress=false", "dist.device=cpu",
        "checkpoint.every_steps=0")


def _command(world_size: int, run_dir: Path, factory: str, folder: Path, *extra: str) -> list[str]:
    return distrib_cmd("train", "--nproc-per-node", world_size,
                       *sets(*BASE, f"data.factory=tests.helpers.streams:{factory}",
                             f'data.kwargs={{folder = "{folder}"}}', f"run.dir={run_dir}", *extra))


def _env(ids: Path | None = None, die_at: int = 0) -> dict[str, str]:
    extra = {"DISTRIB_TEST_IDS": str(ids)} if ids else {}
    if ids:
        ids.mkdir(parents=True, exist_ok=True)
    return clean_env(**extra, **({"DISTRIB_TEST_DIE_AT": str(die_at)} if die_at else {}))


def _run_all(log_dir: Path, commands: list[tuple[list[str], dict]]):
    log_dir.mkdir(parents=True, exist_ok=True)
    with Launches(log_dir) as launches:
        for command, env in commands:
            launches.start(command, env)
        return launches.wait(EVENT_S)


def _trained_ids(folder: Path) -> Counter:
    return Counter(int(i) for path in folder.glob("ids_rank*.txt") for i in path.read_text().split())


def _assert_bitwise(a: Path, b: Path) -> None:
    weights_a, weights_b = load_weights(a), load_weights(b)
    assert all(torch.equal(weights_a[key], weights_b[key]) for key in weights_a)


@pytest.mark.timeout(1200)
def test_a_plain_stream_agrees_across_world_sizes_and_resumes_exactly(tmp_path):
    folder = tmp_path / "shards"
    write_tensor_shards(folder, [37] * 10)  # 370 samples: 23 global batches of 16, 2 left
    extra = ("train.grad_accum_steps=2",)  # micro-batches of 4 at world 2, read by 2 workers in turn
    runs = {name: tmp_path / name for name in ("one", "two", "stopped")}
    done = _run_all(tmp_path / "logs", [
        (_command(1, runs["one"], "plain", folder, *extra), _env()),
        (_command(2, runs["two"], "plain", folder, *extra), _env(tmp_path / "ids")),
        (_command(2, runs["stopped"], "plain", folder, *extra), _env(die_at=15))])
    assert [d.returncode for d in done] == [0, 0, 75], "\n".join(d.text() for d in done)
    assert "the last 2 (a partial global batch) not" in done[1].stderr, done[1].text()
    assert max_relative_diff(load_weights(runs["one"]), load_weights(runs["two"])) < 1e-5
    trained = _trained_ids(tmp_path / "ids")
    assert set(trained) == set(range(368)) and set(trained.values()) == {1}  # each once; the last 2 untrained
    rerun = _run_all(tmp_path / "logs2", [(_command(2, runs["stopped"], "plain", folder, *extra), _env())])[0]
    assert rerun.returncode == 0 and "resumed at step" in rerun.stderr, rerun.text()
    _assert_bitwise(runs["stopped"], runs["two"])


@pytest.mark.timeout(1200)
def test_a_sharded_hugging_face_stream_ends_together_and_resumes_exactly(tmp_path):
    pytest.importorskip("datasets")
    folder = tmp_path / "jsonl"
    write_jsonl_shards(folder, [100, 300, 150, 50])  # rank 0 reads files 0 and 2 (250), rank 1 files 1 and 3 (350)
    runs = {name: tmp_path / name for name in ("two", "stopped")}
    fsdp = "dist.strategy=fsdp"  # sharded checkpoints: the workers' positions go into trainer.pt
    done = _run_all(tmp_path / "logs", [
        (_command(2, runs["two"], "hugging_face", folder, fsdp), _env(tmp_path / "ids")),
        (_command(2, runs["stopped"], "hugging_face", folder, fsdp), _env(die_at=12))])
    assert [d.returncode for d in done] == [0, 75], "\n".join(d.text() for d in done)
    # rank 0's workers: 100 -> 12 micro-batches of 8 (4 left), 150 -> 18 (6 left); 30 steps; rank 1 leaves the rest
    assert "samples left untrained per rank [10, 110]" in done[0].stderr, done[0].text()
    trained = _trained_ids(tmp_path / "ids")
    assert sum(trained.values()) == 30 * 16 and set(trained.values()) == {1}  # no sample twice
    rerun = _run_all(tmp_path / "logs2", [(_command(2, runs["stopped"], "hugging_face", folder, fsdp), _env())])[0]
    assert rerun.returncode == 0 and "resumed at step" in rerun.stderr, rerun.text()
    _assert_bitwise(runs["stopped"], runs["two"])


@pytest.mark.timeout(900)
def test_bad_streams_are_one_line_and_exit_2(tmp_path):
    folder = tmp_path / "shards"
    write_tensor_shards(folder, [37] * 10)
    runs = {name: tmp_path / name for name in ("halfway", "empty")}
    done = _run_all(tmp_path / "logs", [
        (_command(2, runs["halfway"], "plain", folder, "data.kwargs={folder = '%s', bad_after = 300}" % folder,
                  "checkpoint.every_steps=2"), _env()),
        (_command(1, runs["empty"], "empty", folder), _env())])
    assert [d.returncode for d in done] == [2, 2], "\n".join(d.text() for d in done)
    assert "Traceback" not in done[0].stderr + done[1].stderr
    # past the first 256 samples (where the data's kind is learnt): found at step 19, after checkpoint 18
    assert "train data: a sample is a tuple" in done[0].stderr, done[0].text()
    assert "train data: an empty stream" in done[1].stderr, done[1].text()
    kept = sorted(p.name for p in (runs["halfway"] / "checkpoints").iterdir())
    assert "step_00000018.pt" in kept and not [name for name in kept if name.endswith(".tmp")], kept
    assert not (runs["empty"] / "summary.json").exists()
