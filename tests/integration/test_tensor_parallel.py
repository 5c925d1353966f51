"""Tensor parallel 2 x fsdp 2 (world size 4, gloo) on the built-in GPT against one process: the same weights after 12
steps (within float noise across world sizes), the same exact evaluation, half the parameters of fsdp at world size
2 on each rank (distrib plan predicts the run's bytes exactly), and its checkpoint resumed without tensor parallel
(fsdp at world size 2, ddp in one process) at float noise. (Refusals and the data of one tensor-parallel group:
tests/unit/test_tensor_parallel.py)"""

import json
import shutil
from pathlib import Path

import pytest

from distrib.config import load_config
from distrib.plan import Machine, plan_run
from distrib.worker import run_training
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


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tp2_dp2")
    _train(run_dir, *TP)
    return run_dir


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
