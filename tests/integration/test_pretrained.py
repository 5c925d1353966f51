"""model.init_from against a factory that loads the weights itself: a tiny Hugging Face Llama saved by save_pretrained
in several safetensors files, trained 6 steps at world size 1 and under fsdp at world size 2, where no rank builds
the model whole and each rank reads half the bytes; that run's weights/ load with from_pretrained and equal its
model.pt; another model's weights and damaged files are one line on every rank, exit 2, and nothing written. The
world-size-2 runs share one launch."""

import json
import re
import sys

import pytest
import torch

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import launch_runs, split_runs
from tests.helpers.pretrained import damaged_weights, save_llama
from tests.helpers.support import assert_ok, load_weights, max_relative_diff

COMMON = ["data.factory=tests.helpers.pretrained:token_dicts", "train.max_steps=6", "train.epochs=0",
          "train.global_batch_size=16", "train.lr=0.1", "train.warmup_steps=2", "run.progress=false",
          "dist.device=cpu", "checkpoint.every_steps=0"]
RANDOM = "model.factory=tests.helpers.pretrained:llama"  # random weights, replaced by model.init_from
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The folder, the saved Llama (llama/), the damaged cases {name: (source, extra items, why)}, and the launch of
    2 workers: the fsdp run (two/) first, then each case (exit 2); returns (folder, cases, codes, stderr)."""
    tmp = tmp_path_factory.mktemp("pretrained")
    folder = save_llama(tmp / "llama")
    cases = {"wider": (folder, ["model.kwargs={hidden_size = 64}"], "the weights do not fit the model, 21 mis-shaped"),
             **{name: (path.parent, [], f"{path} is not a readable safetensors file (SafetensorError: ")
                for name, path in damaged_weights(tmp / "damaged").items()}}
    runs = [("two", {}, [*COMMON, RANDOM, f"model.init_from={folder}", "dist.strategy=fsdp", f"run.dir={tmp / 'two'}"]),
            *[(name, {}, [*COMMON, RANDOM, *extra, f"model.init_from={source}", "dist.strategy=fsdp",
                          f"run.dir={tmp / name}"]) for name, (source, extra, _) in cases.items()]]
    done = launch_runs(TORCHRUN_2, runs, tmp, codes=tmp / "codes.json")
    assert_ok(done)
    return tmp, cases, json.loads((tmp / "codes.json").read_text()), done.stderr


@pytest.mark.timeout(900)
def test_init_from_a_sharded_hugging_face_folder_equals_from_pretrained_at_world_1_and_under_fsdp(tmp_path, launched):
    from transformers import LlamaForCausalLM

    launch, _, codes, stderr = launched
    folder = launch / "llama"
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    run_training(load_config(None, [*COMMON, "model.factory=tests.helpers.pretrained:llama_from_pretrained",
                                    f"model.kwargs={{folder = '{folder}'}}", f"run.dir={tmp_path / 'reference'}"]))
    run_training(load_config(None, [*COMMON, RANDOM, f"model.init_from={folder}", f"run.dir={tmp_path / 'one'}"]))
    assert codes["two"] == 0, stderr[-5000:]
    two = split_runs(stderr, ["two", *[name for name in codes if name != "two"]])["two"]

    reference = load_weights(tmp_path / "reference")
    initial = LlamaForCausalLM.from_pretrained(folder).state_dict()
    assert max_relative_diff(reference, initial) > 1e-2  # 6 steps moved the weights
    for run_dir in (tmp_path / "one", launch / "two"):
        assert max_relative_diff(load_weights(run_dir), reference) < 1e-5, run_dir
    # No rank built the model whole (not even rank 0 to send the shards), and each fsdp rank read half of the bytes,
    # as the log says (the unit tests count them as read, and check that the factory's parameters were never real).
    assert "no rank held the model whole" in two and "built it whole" not in two, two[-3000:]
    read = re.search(r"model.init_from .*: each rank read ([\d.]+), ([\d.]+) MiB of ([\d.]+) MiB", two)
    assert read, two[-3000:]
    first, second, whole = map(float, read.groups())
    assert first + second == pytest.approx(whole, abs=0.02) and max(first, second) < 0.6 * whole

    saved = LlamaForCausalLM.from_pretrained(launch / "two" / "weights").state_dict()
    model_pt = load_weights(launch / "two")
    assert saved.keys() == model_pt.keys() and all(torch.equal(saved[k], model_pt[k]) for k in saved)


def test_another_models_weights_and_damaged_files_are_one_line_exit_2_on_every_rank_under_fsdp(launched):
    """Weights of a wider model, and a safetensors file cut in half, of 50 bytes and of random bytes (the fault
    sweep's; at world size 1: tests/unit/test_weights.py): under fsdp at world size 2 each rank says one line that
    names the file, exits 2, and nothing is written. In the launch of the fsdp run, after it."""
    tmp, cases, codes, stderr = launched
    assert {name: codes[name] for name in cases} == {name: 2 for name in cases}
    failing = stderr[stderr.index(f"== run {next(iter(cases))} =="):]  # the cases' part: after the fsdp run's
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in failing.splitlines() if "error" in line.lower()]
    assert len(errors) == 2 * len(cases), errors  # one line per rank and run
    for name, (source, _, why) in cases.items():
        mine = [line for line in errors if f"model.init_from = '{source}': " in line]
        assert len(mine) == 2 and mine[0] == mine[1] and why in mine[0], (name, errors)
        assert not (tmp / name).exists()
