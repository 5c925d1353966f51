"""Callbacks in one process: a hook that raises is one line naming the callback and the hook (fit() and the CLI, exit
2, nothing trained past it); callbacks without a known hook, classes for instances and bad train.callbacks are one
line; the frozen-BatchNorm recipe keeps the frozen layers' statistics through evaluations (without it they drift)."""

import pytest
import torch

from distrib import cli, fit
from distrib.config import load_config
from distrib.errors import ConfigError, UserError
from tests.helpers.callbacks import FreezeBatchNorm, HookLog, Misspelled, RaisesAtStep2, fine_tune_data, fine_tune_net
from tests.helpers.fit_hooks_and_hf import OVERRIDES
from tests.helpers.support import REPO, load_weights

SHORT = {**OVERRIDES, "train.epochs": 2}  # 16 steps, an evaluation after the first epoch


def test_a_hook_that_raises_ends_fit_with_one_line_naming_it(tmp_path):
    train, test = fine_tune_data(64, 16)
    with pytest.raises(UserError) as raised:
        fit(fine_tune_net, train, test, overrides={**SHORT, "train.global_batch_size": 16, "run.dir": str(tmp_path)},
            callbacks=[RaisesAtStep2()])
    message = str(raised.value)
    assert message.startswith("callback RaisesAtStep2.on_step_end raised ValueError: no good at step 2; fix the "
                               "callback") and "\n" not in message, message
    assert not (tmp_path / "model.pt").exists() and not (tmp_path / "summary.json").exists()


def test_a_hook_that_raises_is_exit_2_and_one_line_from_the_cli(tmp_path, capsys):
    argv = ["train", *[a for item in ("data.name=synthetic", "data.synthetic_train_size=64",
                                      "data.synthetic_test_size=16", "train.max_steps=4", "train.global_batch_size=16",
                                      "run.progress=false", "dist.device=cpu", f"run.dir={tmp_path}",
                                      'train.callbacks=["tests.helpers.callbacks:RaisesAtStep2"]')
                       for a in ("--set", item)]]
    assert cli.main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("distrib: error")]
    assert len(errors) == 1 and "callback RaisesAtStep2.on_step_end raised ValueError" in errors[0], errors


@pytest.mark.parametrize("callback, match", [
    (Misspelled(), r"^callbacks\[0\]: a Misspelled has none of the hooks on_train_start, on_step_end, on_evaluate, "
                   r"on_train_end \(on_train_begin: did you mean on_train_start\?\); fix: define at least one"),
    (FreezeBatchNorm, r"^callbacks\[0\]: the class FreezeBatchNorm, not an instance; fix: give FreezeBatchNorm\(\)"),
])
def test_callbacks_without_hooks_are_one_line_before_anything_is_written(tmp_path, callback, match):
    train, test = fine_tune_data(64, 16)
    with pytest.raises(UserError, match=match):
        fit(fine_tune_net, train, test, overrides={**SHORT, "run.dir": str(tmp_path / "run")}, callbacks=[callback])
    assert not (tmp_path / "run").exists()


def test_train_callbacks_names_classes_and_is_checked(tmp_path):
    config = load_config(None, ['train.callbacks=["tests.helpers.callbacks:FreezeBatchNorm"]'])
    assert config.train.callbacks == ("tests.helpers.callbacks:FreezeBatchNorm",)
    with pytest.raises(ConfigError, match=r"^train.callbacks = \['FreezeBatchNorm'\]: 'FreezeBatchNorm' must look "
                                          r"like package.module:Class"):
        load_config(None, ['train.callbacks=["FreezeBatchNorm"]'])
    train, test = fine_tune_data(64, 16)
    with pytest.raises(UserError, match=r"^train.callbacks\[0\] = 'tests.helpers.callbacks:Nothing': .* has no "):
        fit(fine_tune_net, train, test, overrides={**SHORT, "run.dir": str(tmp_path / "run"),
                                                   "train.callbacks": ["tests.helpers.callbacks:Nothing"]})


def test_frozen_batchnorm_keeps_its_statistics_through_evaluations_and_hooks_see_the_summary(tmp_path):
    train, test = fine_tune_data()
    log = HookLog(tmp_path / "hooks.jsonl", log_every=4)
    summary = fit(fine_tune_net, train, test, overrides={**SHORT, "run.dir": str(tmp_path / "with")},
                  callbacks=[FreezeBatchNorm(), log])
    fit(fine_tune_net, train, test, overrides={**SHORT, "run.dir": str(tmp_path / "without")})
    torch.manual_seed(0)
    initial = fine_tune_net(4, 3).state_dict()
    kept, drifted = load_weights(tmp_path / "with"), load_weights(tmp_path / "without")
    stats = [name for name in initial if "running_" in name]
    assert len(stats) == 4 and all(torch.equal(kept[name], initial[name]) for name in stats)
    assert all(not torch.equal(drifted[name], initial[name]) for name in stats)
    assert not torch.equal(kept["head.4.weight"], initial["head.4.weight"])  # the head trained
    calls = [line for line in (tmp_path / "hooks.jsonl").read_text().splitlines()]
    assert len(calls) == 1 + 16 + 2 + 1 and '"on_train_end", "steps": 16' in calls[-1]
    assert f'"test_loss": {summary["test_loss"]}' in calls[-2]  # on_evaluate got the exact metrics


def test_the_docs_recipe_runs(tmp_path, monkeypatch, capsys):
    page = (REPO / "docs" / "training-features.md").read_text()
    section = page[page.index("## Callbacks"):]
    code = section[section.index("```python") + len("```python"):section.index("\n```\n")].split("\n", 1)[1]
    monkeypatch.chdir(tmp_path)  # it writes runs/fine-tune
    exec(compile(code, "docs/training-features.md", "exec"), {"__name__": "docs"})
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == ["step 8", "step 16"], printed
    weights = load_weights(tmp_path / "runs" / "fine-tune")
    assert torch.equal(weights["0.1.running_mean"], torch.zeros(16))  # the frozen layer kept its statistics
    assert torch.equal(weights["0.1.running_var"], torch.ones(16))
