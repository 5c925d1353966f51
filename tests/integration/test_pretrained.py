"""model.init_from against a factory that loads the weights itself: a tiny Hugging Face Llama saved by save_pretrained
in several safetensors files, trained 12 steps at world size 1 and under fsdp at world size 2, where no rank builds
the model whole and each rank reads half the bytes; that run's weights/ load with from_pretrained and equal its
model.pt; another model's weights are one line, exit 2, and nothing written."""

import re
import sys

import pytest
import torch

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.pretrained import save_llama
from tests.helpers.support import assert_ok, distrib, load_weights, max_relative_diff, run, sets

COMMON = ["data.factory=tests.helpers.pretrained:token_dicts", "train.max_steps=12", "train.epochs=0",
          "train.global_batch_size=16", "train.lr=0.1", "train.warmup_steps=2", "run.progress=false",
          "dist.device=cpu", "checkpoint.every_steps=0"]
RANDOM = "model.factory=tests.helpers.pretrained:llama"  # random weights, replaced by model.init_from


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


def test_weights_of_another_model_are_one_line_exit_2_and_nothing_written(tmp_path):
    folder = save_llama(tmp_path / "llama")
    run_dir = tmp_path / "wider"
    result = run([sys.executable, "-m", "distrib", "train",
                  *sets(*COMMON, RANDOM, "model.kwargs={hidden_size = 64}", f"model.init_from={folder}",
                        f"run.dir={run_dir}")], timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "the weights do not fit the model" in errors[0] and "mis-shaped" in errors[0]
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()
