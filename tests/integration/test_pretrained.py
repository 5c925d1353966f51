"""model.init_from against a factory that loads the weights itself: a tiny Hugging Face Llama saved by save_pretrained
in several safetensors files, trained 12 steps at world size 1 and under fsdp at world size 2, where no rank builds
the model whole and each rank reads half the bytes; that run's weights/ load with from_pretrained and equal its
model.pt; another model's weights and damaged files are one line on every rank, exit 2, and nothing written."""

import json
import re
import sys

import pytest
import torch

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import launch_runs
from tests.helpers.pretrained import damaged_weights, save_llama
from tests.helpers.support import assert_ok, distrib, load_weights, max_relative_diff, sets

COMMON = ["data.factory=tests.helpers.pretrained:token_dicts", "train.max_steps=12", "train.epochs=0",
          "train.global_batch_size=16", "train.lr=0.1", "train.warmup_steps=2", "run.progress=false",
          "dist.device=cpu", "checkpoint.every_steps=0"]
RANDOM = "model.factory=tests.helpers.pretrained:llama"  # random weights, replaced by model.init_from
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.mark.timeout(900)
def test_init_from_a_sharded_hugging_face_folder_equals_from_pretrained_at_world_1_and_under_fsdp(tmp_path):
    from transformers import LlamaForCausalLM

    folder = save_llama(tmp_path / "llama")
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    run_training(load_config(None, [*COMMON, "model.factory=tests.helpers.pretrained:llama_from_pretrained",
                                    f"model.kwargs={{folder = '{folder}'}}", f"run.dir={tmp_path / 'reference'}"]))
    run_training(load_config(None, [*COMMON, RANDOM, f"model.init_from={folder}", f"run.dir={tmp_path / 'one'}"]))
    two = distrib("train", "--nproc-per-node", "2", *sets(*COMMON, RANDOM, f"model.init_from={folder}",
                                                          "dist.strategy=fsdp", f"run.dir={tmp_path / 'two'}"))
    assert_ok(two)

    reference = load_weights(tmp_path / "reference")
    initial = LlamaForCausalLM.from_pretrained(folder).state_dict()
    assert max_relative_diff(reference, initial) > 1e-2  # 12 steps moved the weights
    for run_dir in ("one", "two"):
        assert max_relative_diff(load_weights(tmp_path / run_dir), reference) < 1e-5, run_dir
    # No rank built the model whole (not even rank 0 to send the shards), and each fsdp rank read half of the bytes,
    # as the log says (the unit tests count them as read, and check that the factory's parameters were never real).
    assert "no rank held the model whole" in two.stderr and "built it whole" not in two.stderr, two.stderr[-3000:]
    read = re.search(r"model.init_from .*: each rank read ([\d.]+), ([\d.]+) MiB of ([\d.]+) MiB", two.stderr)
    assert read, two.stderr[-3000:]
    first, second, whole = map(float, read.groups())
    assert first + second == pytest.approx(whole, abs=0.02) and max(first, second) < 0.6 * whole

    saved = LlamaForCausalLM.from_pretrained(tmp_path / "two" / "weights").state_dict()
    model_pt = load_weights(tmp_path / "two")
    assert saved.keys() == model_pt.keys() and all(torch.equal(saved[k], model_pt[k]) for k in saved)


def test_another_models_weights_and_damaged_files_are_one_line_exit_2_on_every_rank_under_fsdp(tmp_path):
    """Weights of a wider model, and a safetensors file cut in half, of 50 bytes and of random bytes (the fault
    sweep's; at world size 1: tests/unit/test_weights.py): under fsdp at world size 2 each rank says one line that
    names the file, exits 2, and nothing is written. One torchrun launch for the four runs."""
    folder = save_llama(tmp_path / "llama")
    cases = {"wider": (folder, ["model.kwargs={hidden_size = 64}"], "the weights do not fit the model, 21 mis-shaped"),
             **{name: (path.parent, [], f"{path} is not a readable safetensors file (SafetensorError: ")
                for name, path in damaged_weights(tmp_path / "damaged").items()}}
    runs = [(name, {}, [*COMMON, RANDOM, *extra, f"model.init_from={source}", "dist.strategy=fsdp",
                        f"run.dir={tmp_path / name}"]) for name, (source, extra, _) in cases.items()]
    done = launch_runs(TORCHRUN_2, runs, tmp_path, codes=tmp_path / "codes.json")
    assert_ok(done)
    assert json.loads((tmp_path / "codes.json").read_text()) == {name: 2 for name in cases}
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 2 * len(cases), errors  # one line per rank and run
    for name, (source, _, why) in cases.items():
        mine = [line for line in errors if f"model.init_from = '{source}': " in line]
        assert len(mine) == 2 and mine[0] == mine[1] and why in mine[0], (name, errors)
        assert not (tmp_path / name).exists()
