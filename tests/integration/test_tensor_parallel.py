"""Tensor parallel 2 x fsdp 2 (world size 4, gloo) on the built-in GPT against one process: the same weights after 12
steps (within float noise across world sizes), the same exact evaluation, half the parameters of fsdp at world size
2 on each rank (distrib plan predicts the run's bytes exactly), and its checkpoint resumed without tensor parallel
(fsdp at world size 2, ddp in one process) at float noise. (Refusals and the data of one tensor-parallel group:
tests/unit/test_tensor_parallel.py)"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as load_safetensors

from distrib.checkpoint.weights import model_tensors, save_weights
from distrib.config import load_config
from distrib.data import load_data
from distrib.distributed.runtime import Runtime
from distrib.distributed.strategies.materialise import build_whole
from distrib.models.build import build_model
from distrib.plan import Machine, plan_run
from distrib.worker import run_training
from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.pretrained import save_qwen2
from tests.helpers.support import assert_ok, load_weights, max_relative_diff, sets, torchrun_train

TEXT = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files ships it: 35 kB of English prose
GPT = ["model.name=gpt", "model.kwargs={n_layers = 4, n_heads = 4, dim = 64}", "data.name=text",
       f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=3",
       "train.max_steps=12", "train.global_batch_size=16", "train.epochs=0", "train.eval_every_epochs=0",
       "checkpoint.every_steps=6", "train.grad_clip=0.5", "run.progress=false", "dist.device=cpu"]
TP = ["dist.strategy=fsdp", "dist.tensor_parallel=2"]


def _train(run_dir: Path, *overrides: str, nproc: int = 4) -> dict:
    assert_ok(torchrun_train(nproc, *sets(*GPT, f"run.dir={run_dir}", *overrides), timeout=300))
    return json.loads((run_dir / "summary.json").read_text())


def _pretrained(folder: Path) -> Path:
    """The GPT's weights of another seed, as safetensors (model.init_from)."""
    config = load_config(None, [*GPT, "train.seed=5"])
    data = load_data(config.data, Runtime(0, 0, 1, 1, torch.device("cpu"), "gloo"), 5, log=lambda message: None)
    save_weights(model_tensors(build_whole(lambda: build_model(config.model, data.info), 5)), folder, 0)
    return folder


# model.init_from under tensor parallel and hsdp, and a resume that does not read it (the file is gone by then), in
# the same launch of 4 workers as the tensor-parallel run: its start-up is paid once.
LAUNCHED = {"tp2_dp2": TP, "tp_init": [*TP, "model.init_from={pretrained}"],
            "hsdp_init": ["dist.strategy=hsdp", "dist.shard_size=2", "model.init_from={pretrained}",
                          "train.max_steps=6", "train.schedule_steps=12"],
            "hsdp_resumed": ["dist.strategy=hsdp", "dist.shard_size=2", "model.init_from={tmp}/gone",
                             "train.schedule_steps=12", "run.dir={tmp}/hsdp_init"],
            "qwen2_tp": [*TP, "model.init_from={tmp}/qwen2"]}
# transformers' Qwen2 with its own plan as is (embed_tokens embedding_rowwise, lm_head colwise_gather_output, q/k/v
# with biases colwise), on dict samples: its own base, not the GPT's.
QWEN2 = ["data.factory=tests.helpers.pretrained:token_dicts", "model.factory=tests.helpers.pretrained:qwen2",
         "train.optimizer=adamw", "train.lr=3e-3", "train.warmup_steps=2", "train.max_steps=12", "train.epochs=0",
         "train.global_batch_size=16", "run.progress=false", "dist.device=cpu", "checkpoint.every_steps=0"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The folder of the LAUNCHED runs, and each run's part of rank 0's stderr."""
    tmp = tmp_path_factory.mktemp("tp_launch")
    pretrained = _pretrained(tmp / "pretrained")
    save_qwen2(tmp / "qwen2")
    runs = {name: [*(QWEN2 if name.startswith("qwen2") else GPT), f"run.dir={tmp / name}",
                   *[item.format(tmp=tmp, pretrained=pretrained) for item in items]]
            for name, items in LAUNCHED.items()}
    done = torchrun_runs(4, runs, tmp)
    assert_ok(done)
    return tmp, split_runs(done.stderr, list(LAUNCHED))


@pytest.fixture(scope="module")
def tp_run(launched) -> Path:
    return launched[0] / "tp2_dp2"


@pytest.mark.timeout(400)
def test_init_from_under_tensor_parallel_and_hsdp_trains_like_one_process_and_a_resume_does_not_read_it(
        tmp_path, launched):
    """model.init_from at tp 2 x fsdp 2 and at hsdp 2 x 2 (6 steps, then resumed to 12 with model.init_from a path
    that no longer exists: not read, the checkpoint holds every weight) ends where one process ends, within the float
    noise of another world size; each rank of the tensor-parallel run read under a third of the bytes."""
    folder, logs = launched
    one = run_training(load_config(None, [*GPT, f"run.dir={tmp_path}/one", f"model.init_from={folder}/pretrained"]))
    assert one["resumed_from_step"] is None and one["steps"] == 12
    resumed = json.loads((folder / "hsdp_init" / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 6 and resumed["steps"] == 12 and resumed["world_size"] == 4
    tp = json.loads((folder / "tp_init" / "summary.json").read_text())
    assert resumed["flops_per_sample"] == tp["flops_per_sample"] == one["flops_per_sample"] > 0
    reference = load_weights(tmp_path / "one")
    assert max_relative_diff(reference, load_weights(folder / "tp2_dp2")) > 1e-2  # not the seed's own weights
    for name in ("tp_init", "hsdp_init"):
        assert max_relative_diff(load_weights(folder / name), reference) < 1e-5, name
    read = re.search(r"model.init_from .*: each rank read ([\d.]+), ([\d.]+), ([\d.]+), ([\d.]+) MiB of ([\d.]+)",
                     logs["tp_init"])
    assert read and "no rank held the model whole" in logs["tp_init"], logs["tp_init"][-3000:]
    *per_rank, whole = map(float, read.groups())
    assert max(per_rank) < whole / 3, read.group(0)  # a quarter of the matrices, half of what tp replicates
    assert f"model.init_from {folder}/gone: not read, the run resumes from its checkpoint" in logs["hsdp_resumed"]


@pytest.mark.timeout(400)
def test_tp2_dp2_trains_like_one_process_with_half_the_parameters(tmp_path, tp_run):
    one = run_training(load_config(None, [*GPT, f"run.dir={tmp_path}/one"]))
    tp = json.loads((tp_run / "summary.json").read_text())
    assert tp["world_size"] == 4 and one["world_size"] == 1 and tp["steps"] == one["steps"] == 12
    assert max_relative_diff(load_weights(tp_run), load_weights(tmp_path / "one")) < 1e-5
    assert tp["test_count"] == one["test_count"] > 0  # every test window once, not once per tensor-parallel rank
    assert tp["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    planned = plan_run(load_config(None, [*GPT, f"run.dir={tmp_path}/p", *TP]), Machine(1, 4))
    assert planned["state_bytes_per_rank"] == tp["state_bytes_per_rank"]
    fsdp2 = plan_run(load_config(None, [*GPT, f"run.dir={tmp_path}/p", "dist.strategy=fsdp"]), Machine(1, 2))
    assert planned["parameter_bytes_per_rank"] <= 0.55 * fsdp2["parameter_bytes_per_rank"]
    assert planned["collective_bytes_per_step_intra_node"] > fsdp2["collective_bytes_per_step_intra_node"]


@pytest.mark.timeout(400)
def test_tp_checkpoint_resumes_without_tensor_parallel_as_fsdp_at_2_and_ddp_at_1(tmp_path, tp_run):
    """Measured: 5.4e-8 (fsdp 2) and 5.2e-8 (ddp 1) from the uninterrupted run, where uninterrupted runs at world
    sizes 2 and 1 differ from it by 3.7e-6 and 2.7e-6 (AdamW's float noise across world sizes)."""
    for name in ("fsdp2", "ddp1"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(tp_run / "checkpoints" / "step_00000006", tmp_path / name / "checkpoints" / "step_00000006")
    fsdp2 = _train(tmp_path / "fsdp2", "dist.strategy=fsdp", nproc=2)
    ddp1 = run_training(load_config(None, [*GPT, f"run.dir={tmp_path}/ddp1"]))  # ddp in one process: TP 1
    for name, summary in (("fsdp2", fsdp2), ("ddp1", ddp1)):
        assert summary["resumed_from_step"] == 6 and summary["steps"] == 12
        assert max_relative_diff(load_weights(tmp_path / name), load_weights(tp_run)) < 1e-6, name


@pytest.mark.timeout(400)
def test_a_qwen2_with_transformers_own_plan_trains_like_one_process(tmp_path, launched):
    """tp 2 x fsdp 2 with every style of Qwen2's plan against one process, after 12 AdamW steps: every tensor within
    float noise but the key bias, whose true gradient is 0 (softmax ignores a shift shared by every key): AdamW turns
    its float noise into full steps. Measured: 1.9e-6 on the rest, 2.9e-5 and 1.8e-5 on the two key biases; the run
    itself 18 s of the launch."""
    folder, _ = launched
    one = run_training(load_config(None, [*QWEN2, f"run.dir={tmp_path}/one", f"model.init_from={folder}/qwen2"]))
    tp = json.loads((folder / "qwen2_tp" / "summary.json").read_text())
    assert tp["world_size"] == 4 and tp["steps"] == one["steps"] == 12
    weights, reference = load_weights(folder / "qwen2_tp"), load_weights(tmp_path / "one")
    initial = load_safetensors(folder / "qwen2" / "model.safetensors")
    assert max_relative_diff(initial, reference) > 1e-2  # 12 steps moved the weights
    rest = [name for name in reference if not name.endswith("k_proj.bias")]
    assert len(rest) == len(reference) - 2  # two layers' key biases
    assert max_relative_diff({k: weights[k] for k in rest}, {k: reference[k] for k in rest}) < 1e-5
    keys = [name for name in reference if name not in rest]
    assert max_relative_diff({k: weights[k] for k in keys}, {k: reference[k] for k in keys}) < 1e-3
