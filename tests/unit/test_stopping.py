"""Early stopping, EMA weights, best-k checkpoints and honest logs after a restart: a 2-worker run that stops early
against the same run killed in step 11 and resumed; EMA against a reference computed here from every step's weights."""

import io
from pathlib import Path

import pytest
import torch

from distrib.config import load_config
from distrib.metrics import Recorder


@pytest.mark.parametrize("setting, terminal, shown", [("auto", True, True), ("auto", False, False),
                                                      (True, False, True), (False, True, False)])
def test_progress_bar_only_on_a_terminal_when_auto(tmp_path, monkeypatch, setting, terminal, shown):
    stream = io.StringIO()
    monkeypatch.setattr(stream, "isatty", lambda: terminal)
    monkeypatch.setattr("sys.stderr", stream)
    recorder = Recorder(tmp_path, True, setting)
    assert recorder.show_progress is shown
    bar = recorder.progress_bar(10)
    recorder.info("a line")
    bar.update(5)
    bar.close()
    assert ("\r" in stream.getvalue()) is shown and "[distrib] a line\n" in stream.getvalue()


def test_a_log_line_is_one_write_where_print_is_patched(tmp_path, monkeypatch, capfd):
    """Ray Train's workers patch print to write the line and log it too (each distrib line came twice): the
    recorder's lines and the data's are one write to stderr each, never print."""
    import builtins
    from types import SimpleNamespace

    from distrib.data.load import _main_log

    monkeypatch.setattr(builtins, "print", lambda *args, **kwargs: pytest.fail(f"print{args}"))
    Recorder(tmp_path, True, False).info("a line")
    _main_log(SimpleNamespace(is_main=True))("data line")
    _main_log(SimpleNamespace(is_main=False))("another rank's")
    assert capfd.readouterr().err == "[distrib] a line\n[distrib] data line\n"


@pytest.mark.parametrize("overrides, message", [
    (["train.early_stop_metric=loss"], "train.early_stop_metric = 'loss': must be one of test_loss, test_accuracy"),
    (["train.early_stop_metric=test_loss", "train.eval_every_epochs=0"], "needs evaluations during training"),
    (["train.early_stop_patience=0"], "train.early_stop_patience = 0: must be a finite number >= 1"),
    (["train.ema_decay=1.0"], "train.ema_decay = 1.0: must be in [0, 1)"),
    (["checkpoint.keep_best=2", "checkpoint.best_metric=test_accuracy_ema"], "train.ema_decay = 0 keeps none"),
    (["checkpoint.best_metric=accuracy"], "checkpoint.best_metric = 'accuracy': must be one of"),
    (['metrics.loggers=["jsonl","neptune"]'], "'neptune' is not a logger; allowed: jsonl, tensorboard, wandb"),
    (["metrics.logger_errors=ignore"], "metrics.logger_errors = 'ignore': must be one of fail, warn"),
    (["run.progress=sometimes"], "run.progress = 'sometimes': must be auto, true or false"),
])
def test_bad_settings_are_one_line_naming_the_key(overrides, message):
    from distrib.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


class _FakeCheckpointer:
    def __init__(self, directory: Path, run_id: str = ""):
        self.directory, self.run_id = directory, run_id

    def name(self, step: int, *, best: bool = False) -> str:
        from distrib.checkpoint.format import checkpoint_name

        return checkpoint_name("best" if best else "step", step, self.run_id)

    def save(self, step: int, *, best: bool = False) -> Path:
        path = self.directory / f"{self.name(step, best=best)}.pt"
        path.write_text(str(step))
        return path


@pytest.mark.parametrize("run_id", ["", "0123456789ab"], ids=["alone", "beside another run"])
def test_best_set_keeps_the_k_best_and_an_automatic_resume_drops_the_abandoned_future(tmp_path, run_id):
    from distrib.checkpoint.best import BestCheckpoints

    best = BestCheckpoints(2, "test_accuracy", tmp_path, is_main=True)
    for step, accuracy in ((4, 0.5), (8, 0.7), (12, 0.6), (16, 0.6), (20, 0.4)):
        best.consider(step, {"test_accuracy": accuracy}, _FakeCheckpointer(tmp_path, run_id))
    assert [e["step"] for e in best.entries] == [8, 12]  # 16 ties with 12: the earlier stays
    tag = f"-{run_id}" if run_id else ""
    kept = [f"best_00000008{tag}.pt", f"best_00000012{tag}.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    assert [entry["path"] for entry in best.describe()] == [str(tmp_path / name) for name in kept]
    saved = best.state_dict()

    (tmp_path / f"best_00000024{tag}.pt").write_text("from the killed attempt, past its last checkpoint")
    restarted = BestCheckpoints(2, "test_accuracy", tmp_path, is_main=True)
    restarted.load_state_dict(saved)
    restarted.drop_abandoned(resumed_step=20, run_id="any")
    assert restarted.entries == best.entries
    assert sorted(p.name for p in tmp_path.iterdir()) == kept


def test_readers_see_one_history_after_restarts():
    from distrib.metrics.jsonl import last_attempt

    records = [{"step": 2, "loss": 3.0}, {"step": 4, "loss": 2.0}, {"step": 4, "test_loss": 2.5},
               {"step": 6, "loss": 1.9},  # lost: the next attempt resumed at step 4
               {"event": "resume", "step": 4, "resumed_step": 4, "attempt": 2, "restart_count": 1},
               {"step": 4, "test_loss": 2.5},  # the evaluation at the resumed step, redone
               {"step": 6, "loss": 1.8}]
    history = last_attempt(records)
    assert [(r["step"], r.get("loss", r.get("test_loss"))) for r in history if "event" not in r] == [
        (2, 3.0), (4, 2.0), (4, 2.5), (6, 1.8)]


@pytest.mark.timeout(120)
def test_ema_works_on_fsdp_sharded_parameters():
    """FSDP2 (issue 11) makes the parameters DTensors: EMA lerps each rank's shard and gathers only for model_ema.pt."""
    from torch.distributed.fsdp import fully_shard

    from distrib.config import DistConfig
    from distrib.distributed.runtime import open_runtime
    from distrib.models.network import Network
    from distrib.training.ema import EMA

    with open_runtime(DistConfig(device="cpu")) as runtime:
        assert runtime.world_size == 1
        torch.manual_seed(0)
        model = Network()
        fully_shard(model)
        assert all(hasattr(p, "to_local") for p in model.parameters())  # DTensors
        ema = EMA(model, 0.5)
        before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 1, 28, 28)).sum().backward()
        optimizer.step()
        ema.update()
        after = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        averaged = ema.full_state_dict()
        for key in averaged:
            assert torch.allclose(averaged[key], 0.5 * before[key] + 0.5 * after[key], rtol=0, atol=1e-6), key
        with ema.swapped_in():
            assert all(torch.equal(v.full_tensor(), averaged[k]) for k, v in model.state_dict().items())
        assert all(torch.equal(v.full_tensor(), after[k]) for k, v in model.state_dict().items())  # restored
