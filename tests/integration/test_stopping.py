"""Early stopping, EMA weights, best-k checkpoints and honest logs after a restart: a 2-worker run that stops early
against the same run killed in step 11 and resumed; EMA against a reference computed here from every step's weights."""

import json
from pathlib import Path

import pytest
import torch

from distrib.checkpoint.format import read_checkpoint
from distrib.config import load_config
from distrib.distributed.parallel import unwrap
from distrib.metrics.plot import make_figure, read_records
from distrib.training.trained import load_trained
from distrib.training.trainer import Trainer
from distrib.worker import run_training
from tests.helpers.launch_runs import split_runs, torchrun_runs
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, assert_ok, torchrun_train

BASE = ["data.name=synthetic", "data.synthetic_train_size=128", "data.synthetic_test_size=50", "dist.device=cpu",
        "train.global_batch_size=32", "train.log_every=2", "train.schedule=constant", "train.warmup_steps=2"]
# 4 steps an epoch, an evaluation after each. min_delta 1.0 on the loss: the first evaluation (step 4) is the best,
# the next two do not improve enough, so with patience 2 every rank stops after the evaluation at step 12.
STOPPING = [*BASE, "train.epochs=10", "train.early_stop_metric=test_loss", "train.early_stop_patience=2",
            "train.early_stop_min_delta=1.0", "train.ema_decay=0.9", "checkpoint.every_steps=3",
            "checkpoint.keep_last=2", "checkpoint.keep_best=2", "checkpoint.best_metric=test_accuracy",
            "model.factory=tests.helpers.dying_model:network"]
ENV = {"PYTHONPATH": str(REPO)}


def _args(run_dir, *overrides):
    return [a for o in [*STOPPING, f"run.dir={run_dir}", *overrides] for a in ("--set", o)]


def _names(run_dir: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob(pattern))


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _assert_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def _items(run_dir, *overrides):
    return [*STOPPING, f"run.dir={run_dir}", *overrides]


@pytest.mark.timeout(900)
def test_early_stop_on_2_workers_and_the_same_run_killed_and_resumed(tmp_path):
    # Rank 1 dies inside step 11, after step 10 was logged; the newest checkpoint holds step 9, after one evaluation
    # without improvement (so the patience counter is 1 there).
    killed = torchrun_train(2, *_args(tmp_path / "parts"), env={**ENV, "DISTRIB_TEST_DIE_AT": "11"}, timeout=EVENT_S)
    assert killed.returncode != 0
    assert _names(tmp_path / "parts", "step_*.pt")[-1] == "step_00000009.pt"
    # The resumed run and the uninterrupted one, in one launch of 2 workers (one run after the other).
    both = torchrun_runs(2, {"parts": _items(tmp_path / "parts"), "whole": _items(tmp_path / "whole")}, tmp_path)
    assert_ok(both)
    resumed = _summary(tmp_path / "parts")
    assert resumed["resumed_from_step"] == 9 and resumed["steps"] == 12 and resumed["stop_reason"] == "early_stop"

    summary = _summary(tmp_path / "whole")
    assert summary["stop_reason"] == "early_stop" and summary["steps"] == 12, summary
    assert summary["resumed_from_step"] is None, summary
    assert "test_loss did not improve by more than 1 for 2 evaluations" in summary["stop_detail"]
    # stderr is a file, not a terminal: run.progress = auto gives plain lines and no carriage return.
    whole_stderr = split_runs(both.stderr, ["parts", "whole"])["whole"]
    assert "\r" not in both.stderr and "[distrib] step 2 epoch 0 loss" in whole_stderr

    # The same stop, weights, EMA, patience counter and best set as uninterrupted; keep_last pruned step_*.pt only.
    final = {run: read_checkpoint(tmp_path / run / "checkpoints" / "step_00000012.pt", torch.device("cpu"))
             for run in ("whole", "parts")}
    for part in ("model", "optimizer", "ema", "early_stop", "best", "progress"):
        _assert_equal(final["parts"][part], final["whole"][part], part)
    stopping = final["whole"]["early_stop"]
    assert (stopping["best_step"], stopping["num_bad"], stopping["stopped_at"]) == (4, 2, 12)
    _assert_best_kept(tmp_path / "whole")
    assert _names(tmp_path / "parts", "*.pt") == _names(tmp_path / "whole", "*.pt")
    for name in _names(tmp_path / "whole", "best_*.pt"):
        _assert_equal(*(read_checkpoint(tmp_path / run / "checkpoints" / name, torch.device("cpu"))["model"]
                        for run in ("parts", "whole")), name)

    # metrics.jsonl marks the restart; its readers see one history, drawn as one curve.
    lines = [json.loads(line) for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in lines if r.get("event")] == [{"event": "resume", "step": 9, "resumed_step": 9, "attempt": 2,
                                                    "restart_count": 0}]
    assert [r["step"] for r in lines if "loss" in r] == [2, 4, 6, 8, 10, 10, 12]  # step 10: once in each attempt
    assert [r["step"] for r in read_records(tmp_path / "parts") if "loss" in r] == [2, 4, 6, 8, 10, 12]
    figures = [make_figure(read_records(tmp_path / run)) for run in ("parts", "whole")]
    curves = [[(list(line.get_xdata()), list(line.get_ydata())) for axes in f.get_axes()[:2]  # loss, accuracy
               for line in axes.get_lines()] for f in figures]
    assert curves[0] == curves[1]  # throughput (the third axes) differs from run to run


def _assert_best_kept(run_dir: Path) -> None:
    """The two best evaluations by test accuracy (ties: the earlier) have their best_*.pt, and nothing else does."""
    evaluations = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = {r["step"]: r["test_accuracy"] for r in evaluations if "test_accuracy" in r}
    assert sorted(evaluations) == [4, 8, 12]
    best = sorted(evaluations, key=lambda step: (-evaluations[step], step))[:2]
    assert _names(run_dir, "best_*.pt") == [f"best_{step:08d}.pt" for step in sorted(best)]
    assert _names(run_dir, "step_*.pt") == ["step_00000009.pt", "step_00000012.pt"]  # keep_last = 2
    for step in best:
        path = run_dir / "checkpoints" / f"best_{step:08d}.pt"
        state = read_checkpoint(path, torch.device("cpu"))
        assert state["progress"]["step"] == step  # a verified checkpoint: checkpoint.resume=PATH can name it
        trained = load_trained(str(path))  # what `distrib eval PATH` loads
        assert trained.step == step and all(torch.equal(trained.weights[k], v) for k, v in state["model"].items())
    assert [entry["step"] for entry in _summary(run_dir)["best_checkpoints"]] == best


@pytest.mark.timeout(900)
def test_ema_weights_match_a_reference_from_every_steps_weights(tmp_path, monkeypatch):
    weights = []  # the model's weights before the first step and after each step
    real_step = Trainer.step

    def step_and_keep(trainer, micro_batches):
        state = lambda: {k: v.detach().clone().double() for k, v in unwrap(trainer.state.model).state_dict().items()}  # noqa: E731
        if not weights:
            weights.append(state())
        loss = real_step(trainer, micro_batches)
        weights.append(state())
        return loss

    monkeypatch.setattr(Trainer, "step", step_and_keep)
    decay = 0.8
    run_training(load_config(None, [*BASE, f"run.dir={tmp_path}", "train.max_steps=6", f"train.ema_decay={decay}",
                           "run.progress=false"]))
    assert len(weights) == 7
    reference = weights[0]
    for current in weights[1:]:
        reference = {k: decay * reference[k] + (1 - decay) * current[k] for k in current}
    ema = torch.load(tmp_path / "model_ema.pt", weights_only=True)  # a plain state_dict
    assert ema.keys() == reference.keys()
    for key in ema:
        assert torch.allclose(ema[key].double(), reference[key], rtol=0, atol=1e-6), key
    assert max((ema[k].double() - weights[-1][k]).abs().max().item() for k in ema) > 1e-3  # not the raw weights
    evaluations = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"test_loss_ema", "test_accuracy_ema"} <= evaluations[-1].keys()
