"""Context parallel 2 (world size 4, gloo) on the built-in GPT at sequence 256: cp 2 x fsdp 2 and cp 2 x tp 2 train
12 AdamW steps like one process (weights, the logged loss and the exact evaluation of whole windows; measured 4.0e-7
and 8.6e-7), a checkpoint of step 6 resumed under cp 2 x fsdp 2 ends bitwise where the run went on, and resumed as
plain fsdp 4 at float noise (2.5e-8); a transformers Llama (GQA) likewise under cp 2 x fsdp 2 and cp 2 x tp 2
(2.3e-6 and 1.6e-6) and resumed bitwise; packed documents under cp 2 x fsdp 2 like one process (4.3e-7); one launch
of eight runs. (The cut, its inverse, the masks and the gathered attention: tests/unit/test_context_parallel.py)"""

import json
from pathlib import Path

import pytest
import torch

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.support import assert_ok, load_weights, max_relative_diff

TEXT = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files ships it: 35 kB of English prose
GPT = ["model.name=gpt", "model.kwargs={n_layers = 2, n_heads = 4, dim = 32}", "data.name=text", f"data.root={TEXT}",
       "data.seq_len=256", "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=3", "train.max_steps=12",
       "train.global_batch_size=4", "train.epochs=0", "train.eval_every_epochs=0", "checkpoint.every_steps=6",
       "run.progress=false", "dist.device=cpu"]
# A transformers Llama (GQA: 4 heads, 2 of keys and values) whose layers attend through the registered function
LLAMA = [*GPT[2:], "model.factory=tests.helpers.pretrained:llama", "model.kwargs={max_position_embeddings = 256}"]
PACKED = ["data.document_mask=true", "data.eos_id=46"]  # a document ends at each '.' (byte 46)
CP = ["dist.strategy=fsdp", "dist.context_parallel=2"]
STEP_6 = "checkpoint.resume={tmp}/cp_fsdp/checkpoints/step_00000006"
HF_STEP_6 = "checkpoint.resume={tmp}/hf_cp_fsdp/checkpoints/step_00000006"
LAUNCHED = {"cp_fsdp": [*GPT, *CP], "cp_tp": [*GPT, *CP, "dist.tensor_parallel=2"],
            "cp_resumed": [*GPT, *CP, STEP_6], "fsdp_from_cp": [*GPT, "dist.strategy=fsdp", STEP_6],
            "hf_cp_fsdp": [*LLAMA, *CP], "hf_cp_tp": [*LLAMA, *CP, "dist.tensor_parallel=2"],
            "hf_cp_resumed": [*LLAMA, *CP, HF_STEP_6], "packed_cp": [*GPT, *PACKED, *CP]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The folder of the LAUNCHED runs, and each run's part of rank 0's stderr."""
    tmp = tmp_path_factory.mktemp("cp_launch")
    runs = {name: [*[item.replace("{tmp}", str(tmp)) for item in items], f"run.dir={tmp / name}"]
            for name, items in LAUNCHED.items()}
    done = torchrun_runs(4, runs, tmp)
    assert_ok(done)
    return tmp, split_runs(done.stderr, list(LAUNCHED))


def _like_one_process(folder: Path, logs: dict[str, str], one: dict, reference: dict, prefix: str = "") -> None:
    for name, layout in ((f"{prefix}cp_fsdp", "fsdp: shard 2 x cp 2"),
                         (f"{prefix}cp_tp", "fsdp: shard 1 x cp 2 x tp 2")):
        summary = json.loads((folder / name / "summary.json").read_text())
        assert summary["world_size"] == 4 and summary["steps"] == one["steps"] == 12, name
        assert layout in logs[name], logs[name][-3000:]
        assert max_relative_diff(load_weights(folder / name), reference) < 1e-5, name
        assert summary["test_count"] == one["test_count"] > 0  # every test window once, whole
        assert summary["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5), name
        # the loss counts its targets across the C ranks (AdamW's steps would not see a gradient scaled by C)
        assert summary["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5), name


def _resumed(folder: Path, uninterrupted: str, runs: tuple[tuple[str, float], ...]) -> None:
    went_on = load_weights(folder / uninterrupted)
    for name, close in runs:
        summary = json.loads((folder / name / "summary.json").read_text())
        assert summary["resumed_from_step"] == 6 and summary["steps"] == 12, name
        resumed = load_weights(folder / name)
        if close == 0.0:
            assert all(torch.equal(resumed[key], went_on[key]) for key in went_on), name
        assert max_relative_diff(resumed, went_on) <= close, name


@pytest.mark.timeout(400)
def test_cp2_with_fsdp2_and_with_tp2_trains_like_one_process_and_resumes(launched, tmp_path):
    folder, logs = launched
    one = run_training(load_config(None, [*GPT, f"run.dir={tmp_path}/one"]))
    _like_one_process(folder, logs, one, load_weights(tmp_path / "one"))
    _resumed(folder, "cp_fsdp", (("cp_resumed", 0.0), ("fsdp_from_cp", 1e-6)))


@pytest.mark.timeout(400)
def test_a_transformers_llama_under_cp2_trains_like_one_process_and_resumes_bitwise(launched, tmp_path):
    """Its layers run the gathered attention through transformers' attention interface (position_ids: the places)."""
    folder, logs = launched
    one = run_training(load_config(None, [*LLAMA, f"run.dir={tmp_path}/one"]))
    _like_one_process(folder, logs, one, load_weights(tmp_path / "one"), prefix="hf_")
    _resumed(folder, "hf_cp_fsdp", (("hf_cp_resumed", 0.0),))


@pytest.mark.timeout(400)
def test_packed_documents_under_cp2_train_like_one_process(launched, tmp_path):
    """The mask of the global document ids: each rank's queries and the gathered keys keep their documents."""
    folder, logs = launched
    one = run_training(load_config(None, [*GPT, *PACKED, f"run.dir={tmp_path}/one"]))
    summary = json.loads((folder / "packed_cp" / "summary.json").read_text())
    assert "packed documents" in logs["packed_cp"] and summary["steps"] == one["steps"] == 12
    assert max_relative_diff(load_weights(folder / "packed_cp"), load_weights(tmp_path / "one")) < 1e-5
    assert summary["train_loss"] == pytest.approx(one["train_loss"], rel=1e-5)
    assert summary["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
