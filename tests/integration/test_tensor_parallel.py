"""Tensor parallel 2 x fsdp 2 (world size 4, gloo) on the built-in GPT, from the weights of another seed
(model.init_from), against one process: the same weights after 6 steps (within float noise across world sizes), the
same exact evaluation, half the parameters of fsdp at world size 2 on each rank (distrib plan predicts the run's bytes
exactly), and its checkpoint resumed without tensor parallel (fsdp at world size 4, in the same launch, and ddp in one
process) at float noise; model.init_from under hsdp too. (Refusals and the data of one tensor-parallel group:
tests/unit/test_tensor_parallel.py; a Qwen2 and a Llama by transformers' own plans: test_pipeline.py)"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from distrib.checkpoint.weights import model_tensors, save_weights
from distrib.config import load_config
from distrib.data import load_data
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies.materialise import build_whole
from distrib.models.build import build_model
from distrib.plan import Machine, plan_run
from distrib.worker import run_training
from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.support import assert_ok, load_weights, max_relative_diff

TEXT = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files ships it: 35 kB of English prose
GPT = ["model.name=gpt", "model.kwargs={n_layers = 4, n_heads = 4, dim = 64}", "data.name=text",
       f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=3",
       "train.max_steps=6", "train.global_batch_size=16", "train.epochs=0", "train.eval_every_epochs=0",
       "checkpoint.every_steps=3", "train.grad_clip=0.5", "run.progress=false", "dist.device=cpu"]
TP = ["dist.strategy=fsdp", "dist.tensor_parallel=2"]


def _pretrained(folder: Path) -> Path:
    """The GPT's weights of another seed, as safetensors (model.init_from)."""
    config = load_config(None, [*GPT, "train.seed=5"])
    data = load_data(config.data, Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo"), 5, log=lambda message: None)
    save_weights(model_tensors(build_whole(lambda: build_model(config.model, data.info), 5)), folder, 0)
    return folder


# The tensor-parallel run (from model.init_from), its checkpoint resumed as fsdp 4, model.init_from under hsdp and a
# resume that does not read it (the file is gone by then), in one launch of 4 workers: its start-up is paid once.
LAUNCHED = {"tp_init": [*TP, "model.init_from={pretrained}"],
            "fsdp4_from_tp": ["dist.strategy=fsdp", "checkpoint.resume={tmp}/tp_init/checkpoints/step_00000003"],
            "hsdp_init": ["dist.strategy=hsdp", "dist.shard_size=2", "model.init_from={pretrained}",
                          "train.max_steps=3", "train.schedule_steps=6"],
            "hsdp_resumed": ["dist.strategy=hsdp", "dist.shard_size=2", "model.init_from={tmp}/gone",
                             "train.schedule_steps=6", "run.dir={tmp}/hsdp_init"]}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The folder of the LAUNCHED runs, and each run's part of rank 0's stderr."""
    tmp = tmp_path_factory.mktemp("tp_launch")
    pretrained = _pretrained(tmp / "pretrained")
    runs = {name: [*GPT, f"run.dir={tmp / name}",
                   *[item.format(tmp=tmp, pretrained=pretrained) for item in items]]
            for name, items in LAUNCHED.items()}
    done = torchrun_runs(4, runs, tmp)
    assert_ok(done)
    return tmp, split_runs(done.stderr, list(LAUNCHED))


@pytest.fixture(scope="module")
def tp_run(launched) -> Path:
    """tp 2 x fsdp 2 from the weights of another seed (model.init_from)."""
    return launched[0] / "tp_init"


@pytest.fixture(scope="module")
def ones(launched, tmp_path_factory) -> Path:
    """One process from the same model.init_from (one_init/), and from the seed's own weights (one/)."""
    tmp = tmp_path_factory.mktemp("tp_one")
    run_training(load_config(None, [*GPT, f"run.dir={tmp}/one_init", f"model.init_from={launched[0]}/pretrained"]))
    run_training(load_config(None, [*GPT, f"run.dir={tmp}/one"]))
    return tmp


@pytest.mark.timeout(400)
def test_init_from_under_tensor_parallel_and_hsdp_trains_like_one_process_and_a_resume_does_not_read_it(
        ones, launched):
    """model.init_from at tp 2 x fsdp 2 and at hsdp 2 x 2 (3 steps, then resumed to 6 with model.init_from a path
    that no longer exists: not read, the checkpoint holds every weight) ends where one process ends, within the float
    noise of another world size; each rank of the tensor-parallel run read under a third of the bytes."""
    folder, logs = launched
    one = json.loads((ones / "one_init" / "summary.json").read_text())
    assert one["resumed_from_step"] is None and one["steps"] == 6
    resumed = json.loads((folder / "hsdp_init" / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 3 and resumed["steps"] == 6 and resumed["world_size"] == 4
    tp = json.loads((folder / "tp_init" / "summary.json").read_text())
    assert resumed["flops_per_sample"] == tp["flops_per_sample"] == one["flops_per_sample"] > 0
    reference = load_weights(ones / "one_init")
    assert max_relative_diff(reference, load_weights(ones / "one")) > 1e-2  # not the seed's own weights
    for name in ("tp_init", "hsdp_init"):
        assert max_relative_diff(load_weights(folder / name), reference) < 1e-5, name
    read = re.search(r"model.init_from .*: each rank read ([\d.]+), ([\d.]+), ([\d.]+), ([\d.]+) MiB of ([\d.]+)",
                     logs["tp_init"])
    assert read and "no rank held the model whole" in logs["tp_init"], logs["tp_init"][-3000:]
    *per_rank, whole = map(float, read.groups())
    assert max(per_rank) < whole / 3, read.group(0)  # a quarter of the matrices, half of what tp replicates
    assert f"model.init_from {folder}/gone: not read, the run resumes from its checkpoint" in logs["hsdp_resumed"]


@pytest.mark.timeout(400)
def test_tp2_dp2_trains_like_one_process_with_half_the_parameters(tmp_path, tp_run, ones):
    one = json.loads((ones / "one_init" / "summary.json").read_text())
    tp = json.loads((tp_run / "summary.json").read_text())
    assert tp["world_size"] == 4 and one["world_size"] == 1 and tp["steps"] == one["steps"] == 6
    assert max_relative_diff(load_weights(tp_run), load_weights(ones / "one_init")) < 1e-5
    assert tp["test_count"] == one["test_count"] > 0  # every test window once, not once per tensor-parallel rank
    assert tp["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    planned = plan_run(load_config(None, [*GPT, f"run.dir={tmp_path}/p", *TP]), Machine(1, 4))
    assert planned["state_bytes_per_rank"] == tp["state_bytes_per_rank"]
    fsdp2 = plan_run(load_config(None, [*GPT, f"run.dir={tmp_path}/p", "dist.strategy=fsdp"]), Machine(1, 2))
    assert planned["parameter_bytes_per_rank"] <= 0.55 * fsdp2["parameter_bytes_per_rank"]
    assert planned["collective_bytes_per_step_intra_node"] > fsdp2["collective_bytes_per_step_intra_node"]


@pytest.mark.timeout(400)
def test_tp_checkpoint_resumes_without_tensor_parallel_as_fsdp_at_4_and_ddp_at_1(tmp_path, launched, tp_run):
    """Measured: 3.8e-8 (fsdp 4) and 3.7e-8 (ddp 1) from the run continued under tensor parallel, which is 9.8e-7
    from one process (AdamW's float noise across world sizes); at 12 steps, resumed at 6: 5.4e-8 (fsdp 2) and 5.2e-8
    (ddp 1), where uninterrupted runs at world sizes 2 and 1 differed from it by 3.7e-6 and 2.7e-6."""
    (tmp_path / "ddp1" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tp_run / "checkpoints" / "step_00000003", tmp_path / "ddp1" / "checkpoints" / "step_00000003")
    fsdp4 = json.loads((launched[0] / "fsdp4_from_tp" / "summary.json").read_text())
    ddp1 = run_training(load_config(None, [*GPT, f"run.dir={tmp_path}/ddp1"]))  # ddp in one process: TP 1
    for run_dir, summary in ((launched[0] / "fsdp4_from_tp", fsdp4), (tmp_path / "ddp1", ddp1)):
        assert summary["resumed_from_step"] == 3 and summary["steps"] == 6
        assert max_relative_diff(load_weights(run_dir), load_weights(tp_run)) < 1e-6, run_dir.name

