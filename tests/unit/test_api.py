"""The Python API: `from distrib import fit` with a module or a function, datasets or tensors, a Config or a TOML
path, dict overrides and a loss function; `import distrib` stays light; the docstring example and the complete
scripts in scripts/examples run."""

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distrib import Config, fit, load_config
from distrib.errors import ConfigError
from tests.helpers.support import load_weights

OVERRIDES = {"train.max_steps": 12, "train.epochs": 0, "train.global_batch_size": 32, "train.warmup_steps": 2,
             "run.progress": False, "dist.device": "cpu", "checkpoint.every_steps": 0}


def _tensors(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    return torch.randn(n, 2, 6, 6, generator=g) + labels[:, None, None, None], labels


def _model(in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 16), nn.ReLU(),
                         nn.Linear(16, num_classes))


@pytest.mark.timeout(120)
def test_module_or_function_config_or_overrides_give_the_same_training(tmp_path):
    train, test = _tensors(256, 1), _tensors(64, 2)
    by_function = fit(_model, train, test, overrides={**OVERRIDES, "run.dir": str(tmp_path / "a")})
    config = load_config(None, [f"{key}={value}".replace("False", "false") for key, value in OVERRIDES.items()])
    assert isinstance(config, Config)
    torch.manual_seed(config.train.seed)  # the seed fit() uses before calling a model function
    module = _model(2, 3, 6)
    by_module = fit(module, torch.utils.data.TensorDataset(*train), test, config=config,
                    loss_fn=lambda out, target: F.cross_entropy(out, target),
                    overrides={"run.dir": str(tmp_path / "b")})
    a, b = load_weights(tmp_path / "a"), load_weights(tmp_path / "b")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert by_function["steps"] == by_module["steps"] == 12 and by_function["test_count"] == 64
    assert by_module["test_accuracy"] == by_function["test_accuracy"] > 0.5
    assert (tmp_path / "a" / "summary.json").is_file() and (tmp_path / "a" / "config.toml").is_file()


def test_bad_arguments_are_one_line_errors(tmp_path):
    train = _tensors(64, 1)
    with pytest.raises(ConfigError, match=r"^--set 'train.lrr=0.1': unknown key|^train.lrr: unknown key"):
        fit(_model, train, train, overrides={"train.lrr": 0.1})
    with pytest.raises(ConfigError, match=r"^fit\(config=int\): give a TOML path, a distrib.Config or None"):
        fit(_model, train, train, config=42)


@pytest.mark.timeout(120)
def test_fit_init_from_equals_a_model_that_loads_the_weights_itself(tmp_path, capsys):
    """fit(..., init_from=PATH): the same trained weights, bit for bit, as a function that loads PATH itself; weights
    of another model are refused before run.dir is touched; a resumed checkpoint wins over init_from."""
    from distrib.errors import UserError

    train, test = _tensors(192, 0), _tensors(64, 1)
    torch.manual_seed(5)
    pretrained = _model(2, 3, 6).state_dict()
    torch.save(pretrained, tmp_path / "pretrained.pt")

    def loads_itself(in_channels, num_classes, image_size):
        model = _model(in_channels, num_classes, image_size)
        model.load_state_dict(torch.load(tmp_path / "pretrained.pt", weights_only=True))
        return model

    fit(loads_itself, train, test, overrides={**OVERRIDES, "run.dir": str(tmp_path / "itself")})
    fit(_model, train, test, overrides={**OVERRIDES, "run.dir": str(tmp_path / "init")},
        init_from=tmp_path / "pretrained.pt")
    itself, init = load_weights(tmp_path / "itself"), load_weights(tmp_path / "init")
    assert all(torch.equal(itself[k], init[k]) for k in itself)
    assert not torch.equal(init["1.weight"], pretrained["1.weight"])  # trained from there
    with pytest.raises(UserError, match=r"init_from = .*pretrained.pt.*1 mis-shaped \(first 1.weight: \[16, 72\]"):
        fit(lambda: _model(1, 3, 6), train, test, overrides={**OVERRIDES, "run.dir": str(tmp_path / "other")},
            init_from=tmp_path / "pretrained.pt")
    assert not (tmp_path / "other").exists()

    # A resumed checkpoint wins, and init_from is not even read: 6 steps from `pretrained`, then a restart whose
    # init_from is a damaged file continues the checkpoint, ending bitwise where the uninterrupted run ends.
    (tmp_path / "damaged.pt").write_bytes(b"not a torch file")
    halves = {**OVERRIDES, "run.dir": str(tmp_path / "halves"), "checkpoint.every_steps": 6, "train.schedule_steps": 12}
    fit(_model, train, test, overrides={**halves, "train.max_steps": 6}, init_from=tmp_path / "pretrained.pt")
    resumed = fit(_model, train, test, overrides=halves, init_from=tmp_path / "damaged.pt")
    assert resumed["resumed_from_step"] == 6
    assert all(torch.equal(tensor, init[k]) for k, tensor in load_weights(tmp_path / "halves").items())
    # This run's checkpoint, seen at start-up, that cannot be resumed (its checksum fails; beside another run's:
    # foreign=keep) starts the run afresh from init_from after all: bitwise the uninterrupted run.
    for checkpoint in (tmp_path / "halves" / "checkpoints").glob("step_*.pt"):
        state = torch.load(checkpoint, weights_only=True)
        state["model"]["1.weight"] += 1  # its run id still reads
        torch.save(state, checkpoint)
    again = fit(_model, train, test, overrides={**halves, "checkpoint.foreign": "keep"},
                init_from=tmp_path / "pretrained.pt")
    assert again["resumed_from_step"] is None and "checksum mismatch" in capsys.readouterr().err
    assert all(torch.equal(tensor, init[k]) for k, tensor in load_weights(tmp_path / "halves").items())


class ChangesShape(torch.utils.data.IterableDataset):
    """A stream whose samples grow a feature past the first 256 (where the data's kind is learnt): mid-pass."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for index in range(400):
            yield torch.randn(4 if index < 300 else 5, generator=g), index % 3


def _exits(code: int):
    raise SystemExit(code)


@pytest.mark.timeout(120)
def test_an_uncaught_fit_error_ends_the_script_in_one_line_with_its_exit_code(tmp_path, monkeypatch, capfd):
    """fit() raises the typed error (a script may catch it); uncaught, its excepthook says one line and ends the
    process with the error's exit code: rank 0 alone says a config mistake (found on every rank), a worker of distrib
    launch writes it to torch's error file instead; any other exception goes to the hook before."""
    import distrib.api
    import distrib.errors
    from distrib.errors import EnvironmentFault, UserError
    from distrib.launch.reporting import REPORTS_VAR

    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_MAX_RESTARTS", REPORTS_VAR):
        monkeypatch.delenv(name, raising=False)
    before, waits = [], []
    monkeypatch.setattr(sys, "excepthook", lambda *exc: before.append(exc[1]))
    monkeypatch.setattr(distrib.errors, "hard_exit", _exits)  # os._exit would end pytest
    monkeypatch.setattr(distrib.api, "time", SimpleNamespace(sleep=waits.append))

    def uncaught(error) -> tuple[int, str]:
        with pytest.raises(SystemExit) as ended:
            sys.excepthook(type(error), error, error.__traceback__)
        return ended.value.code, capfd.readouterr().err

    def fit_error(**kw) -> UserError:
        with pytest.raises(UserError) as raised:
            fit(_model, *[_tensors(64, 1)] * 2, **kw)
        return raised.value

    mistake = fit_error(overrides={"train.lrr": 0.1})
    assert type(mistake) is ConfigError and sys.excepthook.previous is not None
    said = "distrib: error: train.lrr: unknown key; did you mean 'lr'?\n"
    assert uncaught(mistake) == (2, said) and waits == []
    sys.excepthook(ValueError, ValueError("not ours"), None)
    assert [str(e) for e in before] == ["not ours"]

    monkeypatch.setenv("RANK", "1")  # every rank found it: rank 1 leaves it to rank 0, then says it
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert uncaught(fit_error(overrides={"train.lrr": 0.1})) == (2, said) and waits == [distrib.api.RANK_0_WAIT_S]

    # distrib launch's worker on its last attempt: its error file, for the launcher's last line; its own disk fault
    # (exit 74, its own story) it says itself.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv(REPORTS_VAR, "1")
    assert uncaught(fit_error(overrides={"train.lrr": 0.1})) == (2, "")
    assert "ConfigError: train.lrr: unknown key" in (tmp_path / "error.json").read_text()
    assert uncaught(EnvironmentFault("run.dir: disk full")) == (74, "distrib: error: run.dir: disk full\n")


@pytest.mark.timeout(120)
def test_a_stream_that_changes_shape_mid_pass_is_one_line_and_exit_2(tmp_path, monkeypatch, capfd):
    """Found by every rank alike at one step (distrib.data.stream's vote), raised by fit() as the typed error, said
    as the CLI says it: one line, exit 2 (under distrib launch, its last line names it once for every rank)."""
    import distrib.errors
    from distrib.errors import UserError

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after
    monkeypatch.setattr(distrib.errors, "hard_exit", _exits)  # os._exit would end pytest
    test = (torch.randn(64, 4), torch.randint(0, 3, (64,)))
    with pytest.raises(UserError) as raised:  # the typed error, as a script may catch it
        fit(nn.Linear(4, 3), ChangesShape(), test, overrides={**OVERRIDES, "train.max_steps": 0, "train.epochs": 1,
                                                               "train.schedule": "constant",
                                                               "run.dir": str(tmp_path / "run")})
    capfd.readouterr()
    with pytest.raises(SystemExit) as ended:
        sys.excepthook(type(raised.value), raised.value, raised.value.__traceback__)
    said = capfd.readouterr().err
    assert ended.value.code == 2 and said.count("\n") == 1, said
    assert said.startswith("distrib: error: train data: a sample of float32 [5] -> int64 [], where the data's samples "
                           "are float32 [4] -> int64 [] (at step 10 of pass 0"), said
