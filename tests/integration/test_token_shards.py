"""Token shards end to end: llm.c's Llama 3 shards (3 train, 1 val; uint32 ids over 65,535, a vocabulary of 128,256)
through data.train_files / data.test_files, packed as documents (data.document_mask, data.eos_id), train the same at
world sizes 1 and 2, evaluate every held-out token, and a worker killed mid-run (SIGKILL, --max-restarts 1) is
restarted and ends bitwise where the uninterrupted run ends; `distrib eval` of a run, or of its weights/ folder, gives
its test metrics to the bit (ddp at world size 1 and 2, evaluated at 1); a truncated shard is one line and exit 2,
before the run and under it; shards (GPT-2's, uint16) changed before a resume are one line naming the file, exit 2 on
every rank (world sizes 1 and 2), unless allowed."""

import json
import os
import re
import shutil
import sys

import pytest
import torch

from distrib import cli
from distrib.checkpoint.format import digest
from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import launch_runs, split_runs
from tests.helpers.support import max_relative_diff, sets
from tests.helpers.token_shards import (
    LLAMA3,
    LLAMA3_VOCAB,
    CutShardsShort,
    learnable_stream,
    write_llmc,
    write_llmc_shards,
)

VAL_TOKENS = 700
RUN = ["data.name=tokens", "data.vocab_size=64", "data.seq_len=16", "model.factory=tests.helpers.dying_model:gpt",
       "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=4", "train.schedule=constant",
       "train.global_batch_size=8", "train.log_every=4", "train.max_steps=12", "train.epochs=0",
       "train.eval_every_epochs=0", "run.progress=false", "dist.device=cpu", "checkpoint.every_steps=4"]


@pytest.mark.timeout(900)
def test_llama3_shards_agree_across_world_sizes_count_every_val_token_and_resume_bitwise_after_a_kill(tmp_path,
                                                                                                      capfd):
    def llama3_ids(num_tokens: int, seed: int = 0):  # the last 64 ids of Llama 3's vocabulary: all over 65,535
        return learnable_stream(num_tokens, seed=seed) + LLAMA3_VOCAB - 64

    train, val = write_llmc_shards(tmp_path / "data", llama3_ids(3 * 1500 + VAL_TOKENS), (1200, 1500, 1800), **LLAMA3)
    # Packed documents (data.document_mask): each ends with the stream's first id, and each shard starts one.
    run = [*RUN, f"data.vocab_size={LLAMA3_VOCAB}", f"data.train_files={train}", f"data.test_files={val}",
           "data.document_mask=true", f"data.eos_id={LLAMA3_VOCAB - 64}"]
    one = run_training(load_config(None, [*run, f"run.dir={tmp_path}/one"]))
    # A copy of the shards elsewhere, one of them with other tokens of the same size: resumed from run one's
    # checkpoint 8 at world size 2, it is refused on every rank.
    shutil.copytree(tmp_path / "data", tmp_path / "copy")
    write_llmc(tmp_path / "copy" / "shard_train_000001.bin", llama3_ids(1500, seed=1), **LLAMA3)
    changed = [*run, f"data.train_files={tmp_path}/copy/shard_train_*.bin",
               f"data.test_files={tmp_path}/copy/shard_val_*.bin", f"run.dir={tmp_path}/changed",
               f"checkpoint.resume={tmp_path}/one/checkpoints/step_00000008.pt"]
    # One launch of 2 workers, three runs (tests/helpers/train_runs.py): the uninterrupted one, then one whose rank 1
    # kills itself (SIGKILL) inside step 10 of its first attempt, then (in the second attempt only) the refused
    # resume. The launcher restarts both workers: the finished run trains nothing, the killed one resumes from
    # checkpoint 8 and ends where the uninterrupted one ended, to the bit.
    runs = [("two", {}, [*run, f"run.dir={tmp_path}/two"]),
            ("killed", {"DISTRIB_TEST_DIE_AT": "10", "DISTRIB_TEST_DIE_ONCE": str(tmp_path / "died")},
             [*run, f"run.dir={tmp_path}/killed"]),
            ("changed", {"DISTRIB_LAUNCH_REPORTS": "0"}, changed)]  # each rank says its error, not the launcher
    result = launch_runs([sys.executable, "-m", "distrib", "launch", "--nproc-per-node=2", "--max-restarts=1"], runs,
                         tmp_path, codes=tmp_path / "codes.json")
    out = result.stdout + result.stderr
    assert result.returncode == 0 and (tmp_path / "died").exists(), out[-4000:]
    assert f"packed documents (each attends only to itself; one starts after id {LLAMA3_VOCAB - 64}," in out
    assert json.loads((tmp_path / "codes.json").read_text()) == {"two": 0, "killed": 0, "changed": 2}, out[-4000:]
    refused = split_runs(result.stderr, ["two", "killed", "changed"])["changed"]
    assert refused.count(f"step_00000008.pt: the data changed since it was taken ({tmp_path}/copy/shard_train_000001"
                         ".bin: other content (the same 7024 bytes)), so a resume would not continue") == 2, refused
    assert "Traceback" not in refused and not list((tmp_path / "changed").glob("checkpoints/step_*"))
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["restart_count"] == 0, two  # finished in the first attempt, before the kill
    weights = {name: torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("one", "two")}
    assert max_relative_diff(weights["one"], weights["two"]) < 1e-5
    assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    assert one["test_token_count"] == two["test_token_count"] == VAL_TOKENS - 1  # all but the first have a context
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert (summary["restart_count"], summary["resumed_from_step"], summary["steps"]) == (1, 8, 12), summary
    killed = torch.load(tmp_path / "killed" / "model.pt", weights_only=True)
    assert all(torch.equal(killed[key], weights["two"][key]) for key in weights["two"])
    assert summary["test_loss"] == two["test_loss"]
    _eval_gives_the_runs_test_metrics_to_the_bit(tmp_path, one, two)

    # A shard cut short (its header says more tokens than it holds): one line naming it, exit 2, nothing written.
    write_llmc(tmp_path / "data" / "shard_train_000001.bin", llama3_ids(1000), count=1500, **LLAMA3)
    capfd.readouterr()
    code = cli.main(["train", *sets(*run, f"run.dir={tmp_path}/bad")])  # as `distrib train` runs it, in this process
    said = capfd.readouterr().err
    assert code == 2 and not (tmp_path / "bad").exists(), said[-2000:]
    assert said.strip().splitlines()[-1] == (
        f"distrib: error: data.train_files: {tmp_path}/data/shard_train_000001.bin is truncated: its header says "
        "1500 tokens, the file holds 1000; fix: copy or write it again")


def _eval_gives_the_runs_test_metrics_to_the_bit(tmp_path, one: dict, two: dict) -> None:
    """distrib eval in this process (world size 1) of run one (trained at world size 1), and of run two's weights/
    folder (trained at 2 under ddp: eval runs the model whole, as ddp did): the folder itself is evaluated, and
    eval.json is written beside it, not in the export."""
    for run, summary, source in (("one", one, tmp_path / "one"), ("two", two, tmp_path / "two" / "weights")):
        assert cli.main(["eval", str(source)]) == 0
        evaluated = json.loads((tmp_path / run / "eval.json").read_text())
        assert evaluated["source"] == str(source) and evaluated["world_size"] == 1, evaluated
        assert {key: evaluated[key] for key in summary if key.startswith("test_")} == {
            key: value for key, value in summary.items() if key.startswith("test_")}  # to the bit
    assert not (tmp_path / "two" / "weights" / "eval.json").exists()


def _train(capfd, *overrides: str) -> tuple[int, str]:
    """`distrib train` in this process (world size 1): its exit code and what it said on stderr."""
    capfd.readouterr()
    code = cli.main(["train", *sets(*overrides)])
    return code, capfd.readouterr().err


@pytest.mark.timeout(600)
def test_shards_changed_before_a_resume_are_one_line_naming_the_file_unless_allowed(tmp_path, capfd):
    stream = learnable_stream(3 * 1500 + VAL_TOKENS)
    train, val = write_llmc_shards(tmp_path / "data", stream, (1200, 1500, 1800))
    run = [*RUN, f"data.train_files={train}", f"data.test_files={val}", "train.max_steps=8"]
    assert _train(capfd, *run, f"run.dir={tmp_path}/whole")[0] == 0
    assert _train(capfd, *run, f"run.dir={tmp_path}/parts", "train.max_steps=4")[0] == 0
    for name in ("allowed", "old"):
        shutil.copytree(tmp_path / "parts", tmp_path / name)
    old = tmp_path / "old" / "checkpoints" / "step_00000004.pt"  # as a distrib before data identities wrote it
    state = torch.load(old, weights_only=True)
    del state["data_identity"]
    torch.save({**state, "checksum": digest(state)}, old)
    shard = tmp_path / "data" / "shard_train_000001.bin"
    original = shard.read_bytes()
    refused = (f"distrib: error: checkpoint {tmp_path}/parts/checkpoints/step_00000004.pt: the data changed since it "
               "was taken ({}), so a resume would not continue the same run; restore the data, use a new "
               "checkpoint.dir, or --set checkpoint.allow_config_change=true")
    written = {path: path.read_bytes() for path in (tmp_path / "parts").rglob("*")
               if path.is_file() and path.name != ".distrib.lock"}  # the lock says who holds the folder now
    write_llmc(shard, learnable_stream(1500, seed=1))  # the same size, other tokens
    code, said = _train(capfd, *run, f"run.dir={tmp_path}/parts")
    assert code == 2 and said.strip().splitlines()[-1] == refused.format(
        f"{shard}: other content (the same 4024 bytes)"), said[-2000:]
    write_llmc(shard, stream[1200:2500])  # 1300 of its 1500 tokens
    code, said = _train(capfd, *run, f"run.dir={tmp_path}/parts")
    assert code == 2 and said.strip().splitlines()[-1] == refused.format(f"{shard}: 4024 -> 3624 bytes"), said[-2000:]
    assert {path: path.read_bytes() for path in written} == written  # refused before anything is written

    code, said = _train(capfd, *run, f"run.dir={tmp_path}/allowed", "checkpoint.allow_config_change=true")
    assert code == 0 and "resumed at step 4" in said, said[-2000:]
    assert (f"step_00000004.pt: resumed on changed data, as checkpoint.allow_config_change allows: {shard}: 4024 -> "
            "3624 bytes") in said
    code, said = _train(capfd, *run, f"run.dir={tmp_path}/old")
    assert code == 0 and "resumed at step 4" in said and (
        f"checkpoint {old}: records nothing that identifies its data (it was written before distrib did), so this "
        "run cannot check that it reads the same data") in said, said[-2000:]
    # The refused resumes wrote nothing: on the files restored, the run resumes and ends bitwise as the whole one.
    shard.write_bytes(original)
    code, said = _train(capfd, *run, f"run.dir={tmp_path}/parts")
    assert code == 0 and "resumed at step 4" in said and "data changed" not in said, said[-2000:]
    weights = [torch.load(tmp_path / name / "model.pt", weights_only=True) for name in ("parts", "whole")]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[1])


@pytest.mark.timeout(600)
def test_a_shard_cut_short_under_a_live_run_is_one_line_and_exit_2_with_its_checkpoint_kept(tmp_path, capfd,
                                                                                           monkeypatch):
    train, val = write_llmc_shards(tmp_path / "data", learnable_stream(3 * 1500 + VAL_TOKENS), (1200, 1500, 1800))
    sizes = {str(path): path.stat().st_size for path in sorted((tmp_path / "data").glob("shard_train_*.bin"))}
    monkeypatch.setenv("DISTRIB_TEST_CUT_AT", "4")  # after step 4 and its checkpoint: every train shard to its header
    monkeypatch.setenv("DISTRIB_TEST_CUT_FILES", os.pathsep.join(sizes))
    code, said = _train(capfd, *RUN, f"data.train_files={train}", f"data.test_files={val}", f"run.dir={tmp_path}/run",
                        f'train.callbacks=["{CutShardsShort.__module__}:CutShardsShort"]')
    last = said.strip().splitlines()[-1]
    found = re.fullmatch(r"distrib: error: data.train_files: (\S+) was cut short under the run: it holds 1024 bytes, "
                         r"(\d+) when the run opened it; fix: restore the file and run the same command again \(it "
                         r"resumes from the last checkpoint\)", last)
    assert code == 2 and found and sizes[found[1]] == int(found[2]), said[-2000:]
    assert "Traceback" not in said and "step 5" not in said
    kept = torch.load(tmp_path / "run" / "checkpoints" / "step_00000004.pt", weights_only=True)
    assert kept["progress"]["step"] == 4
