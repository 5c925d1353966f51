"""Tasks other than image classification, from user code outside the project: a byte-level GPT on int64 [N, T] pairs
(world size 1, 2 and fsdp), dict samples and a model's own loss through fit() and torchrun, a float regression with
the user's metric, segmentation and multi-label targets; every result checked against an independent computation.
The world-size-2 runs of every test share one torchrun launch (SCRIPT); world size 1 runs in this process."""

import json
import math
import os
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from distrib.config import load_config
from distrib.worker import run_training
from tests.helpers.processes import EVENT_S
from tests.helpers.support import REPO, SMALL, assert_ok, load_weights, max_relative_diff, run
from tests.helpers.task_package import write_task_package

BASE = [*SMALL, "train.epochs=0", "train.warmup_steps=2", "train.log_every=4", "train.global_batch_size=16"]
GPT = [*BASE, "data.factory=taskpkg.data:bytes_lm", "model.factory=taskpkg.models:gpt", "train.max_steps=12",
       "train.optimizer=adamw", "train.lr=0.003", "train.weight_decay=0.1", "train.betas=[0.9,0.95]"]
REGRESSION = [*BASE, "data.factory=taskpkg.data:regression", "model.factory=taskpkg.models:regressor",
              "train.loss=mse", "train.optimizer=adam", "train.lr=0.01", "train.max_steps=10",
              'metrics.eval=["taskpkg.metrics:mae"]']
DENSE = {  # one class per pixel with -100 on some (uneven counts per rank), and several labels per sample
    "segmentation": [*BASE, "data.factory=taskpkg.data:segmentation", "model.factory=taskpkg.models:segmenter",
                     "train.max_steps=8", "train.grad_accum_steps=2", "train.lr=0.1"],
    "multilabel": [*BASE, "data.factory=taskpkg.data:multilabel", "model.factory=taskpkg.models:tagger",
                   "train.loss=bce_with_logits", "train.max_steps=8", "train.lr=0.1"],
}

FIT_OVERRIDES = {"train.max_steps": 8, "train.epochs": 0, "train.global_batch_size": 16, "train.optimizer": "adamw",
                 "train.lr": 0.003, "train.warmup_steps": 2, "run.progress": False, "dist.device": "cpu",
                 "checkpoint.every_steps": 0}
MULTITASK_OVERRIDES = {**FIT_OVERRIDES, "train.max_steps": 6, "train.optimizer": "adam", "train.lr": 0.01,
                       "data.eval_batch_size": 300}
# A plain stream of 16-id samples, every third run of four shorter, and a map-style ragged test set (a list): padded
# alike in every micro-batch at both world sizes (tests/helpers/stream_kinds.py).
RAGGED_STREAM_OVERRIDES = {**FIT_OVERRIDES, "train.max_steps": 12, "train.global_batch_size": 8,
                           "train.optimizer": "sgd", "train.lr": 0.5, "train.schedule": "constant",
                           "data.eval_batch_size": 6}
# SGD: GPT-2's attention has a key bias, whose true gradient is zero (softmax ignores a constant per row); Adam would
# scale its rounding noise, which differs between world sizes, up to whole steps.
HF_GPT2 = [*BASE, "data.factory=taskpkg.data:dict_lm", "model.factory=taskpkg.models:gpt2", "train.max_steps=6",
           "train.lr=0.1"]
# The world-size-2 runs of every test here, in ONE torchrun launch (its process start-up is most of a run's cost):
# each `distrib train` run as its launched workers run it (distrib.cli.main, which opens and closes its own process
# group), then two scripts' distrib.fit calls, as a user's script under torchrun makes them.
TWO_PROCESS_RUNS = {
    "gpt_ws2": GPT, "gpt_fsdp": [*GPT, "dist.strategy=fsdp"], "regression": REGRESSION,
    # At world size 2 through the DataLoader: the same batches as the device path.
    **{task: [*overrides, "data.loader=dataloader"] for task, overrides in DENSE.items()},
    "hf_gpt2_fsdp": [*HF_GPT2, "dist.strategy=fsdp"],
}
SCRIPT = f'''
"""Every world-size-2 run of test_tasks.py: torchrun --nproc-per-node=2 train.py OUT."""
import os
import sys
from pathlib import Path

from taskpkg.data import dict_lm, multitask
from taskpkg.metrics import label_accuracy, multitask_loss, next_token_accuracy
from taskpkg.models import DictLM, TwoHeads

from distrib import cli, fit
from tests.helpers.stream_kinds import CausalBag, ragged_ids, ragged_test

out, rank = Path(sys.argv[1]), os.environ["RANK"]
# dict samples and a model that returns its own loss
summary = fit(DictLM, *dict_lm(), overrides={{"run.dir": str(out / "fit_dict"), **{FIT_OVERRIDES!r}}},
              metrics=[next_token_accuracy])
print(f"rank done: test loss {{summary['test_loss']:.4f}}")
print(f"fit_dict done on rank {{rank}}", file=sys.stderr, flush=True)
# a multi-task model with a dict output, the user's loss and metric
train, test = multitask()
fit(TwoHeads, train, test, overrides={{"run.dir": str(out / "multitask"), **{MULTITASK_OVERRIDES!r}}},
    loss_fn=multitask_loss, metrics=[label_accuracy])
fit(CausalBag, ragged_ids(), ragged_test(), overrides={{"run.dir": str(out / "ragged_stream"),
                                                       **{RAGGED_STREAM_OVERRIDES!r}}})
for name, overrides in {TWO_PROCESS_RUNS!r}.items():
    sets = [item for each in [*overrides, f"run.dir={{out / name}}"] for item in ("--set", each)]
    code = cli.main(["train", *sets])
    assert code == 0, (name, code)
'''


@pytest.fixture(scope="module")
def task_root(tmp_path_factory):
    root = write_task_package(tmp_path_factory.mktemp("outside"))
    sys.path.insert(0, str(root))  # the in-process runs and the independent checks import taskpkg too
    yield root
    sys.path.remove(str(root))


def _env(root) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(root), str(REPO), os.environ.get("PYTHONPATH", "")])}


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _one_process(run_dir, overrides) -> dict:
    return run_training(load_config(None, [*overrides, f"run.dir={run_dir}"]))


@pytest.fixture(scope="module")
def two(task_root, tmp_path_factory):
    """The folder of every world-size-2 run (TWO_PROCESS_RUNS, fit_dict, multitask) and the launch's output."""
    out = tmp_path_factory.mktemp("two")
    script = out / "train.py"
    script.write_text(textwrap.dedent(SCRIPT).lstrip())
    done = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                str(out)], timeout=2 * EVENT_S, env=_env(task_root))
    assert_ok(done)
    return out, done


def _two_processes(two, name) -> dict:
    summary = _summary(two[0] / name)
    assert summary["world_size"] == 2
    return summary


def _trained(run_dir, model):
    model.load_state_dict(load_weights(run_dir))
    return model.eval()


@pytest.mark.timeout(900)
def test_byte_level_gpt_agrees_at_world_sizes_1_2_and_under_fsdp(task_root, two, tmp_path):
    from taskpkg.data import bytes_lm
    from taskpkg.models import gpt

    summaries = {"ws1": _one_process(tmp_path / "ws1", GPT),
                 "ws2": _two_processes(two, "gpt_ws2"), "fsdp": _two_processes(two, "gpt_fsdp")}
    folders = {"ws1": tmp_path / "ws1", "ws2": two[0] / "gpt_ws2", "fsdp": two[0] / "gpt_fsdp"}
    _, (test_x, test_y) = bytes_lm()
    for name, summary in summaries.items():
        assert summary["steps"] == 12 and summary["data"]["inputs"] == "int64 [16]", name
        assert max_relative_diff(load_weights(folders[name]), load_weights(folders["ws1"])) < 1e-5, name
        with torch.no_grad():  # the mean cross-entropy over every test token, from model.pt alone
            logits = _trained(folders[name], gpt(16))(test_x)
        expected = F.cross_entropy(logits.double().reshape(-1, 256), test_y.reshape(-1)).item()
        assert summary["test_loss"] == pytest.approx(expected, rel=1e-5), name
        assert summary["test_perplexity"] == pytest.approx(math.exp(summary["test_loss"]))
        assert summary["test_token_count"] == test_y.numel() and "test_accuracy" not in summary
        right = (logits.argmax(-1) == test_y).sum().item()
        assert summary["test_token_accuracy"] == right / test_y.numel()
    assert summaries["ws2"]["train_loss"] < math.log(256)  # it learned something: below a uniform guess


@pytest.mark.timeout(900)
def test_dict_samples_and_the_models_own_loss_through_fit_and_torchrun(task_root, two, tmp_path):
    from taskpkg.data import dict_lm
    from taskpkg.metrics import next_token_accuracy
    from taskpkg.models import DictLM

    out, launch = two
    assert launch.stdout.count("rank done") == 2
    assert 0 <= launch.stderr.find("the model's own outputs.loss") < launch.stderr.index("fit_dict done on rank 0")
    from distrib import fit

    train, test = dict_lm()
    fit(DictLM, train, test, overrides={"run.dir": str(tmp_path / "one"), **FIT_OVERRIDES},  # as one process
        metrics=[next_token_accuracy])
    one, both = _summary(tmp_path / "one"), _summary(out / "fit_dict")
    assert one["world_size"] == 1 and both["world_size"] == 2
    assert max_relative_diff(load_weights(out / "fit_dict"), load_weights(tmp_path / "one")) < 1e-5
    batch = {key: torch.stack([test[i][key] for i in range(len(test))]) for key in test[0]}
    for folder, summary in ((tmp_path / "one", one), (out / "fit_dict", both)):
        with torch.no_grad():  # one evaluation batch holds the whole test set: its loss is the model's own on all of it
            outputs = _trained(folder, DictLM())(**batch)
        right = outputs.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]
        assert summary["test_loss"] == pytest.approx(outputs.loss.item(), rel=1e-5)
        assert summary["test_next_token_accuracy"] == right.sum().item() / right.numel()  # fit(metrics=[...])
        assert summary["test_count"] == len(test) and "test_perplexity" in summary
        assert "test_token_accuracy" not in summary  # its logits are shifted against its labels: no built-in one


@pytest.mark.timeout(900)
def test_a_ragged_stream_through_fit_agrees_at_world_sizes_1_and_2(task_root, two, tmp_path):
    """Before, a micro-batch whose samples happened to be alike had no attention_mask, and the run stopped; the
    model needs the mask in every micro-batch, and takes no labels (they are the targets)."""
    from distrib import fit
    from tests.helpers.stream_kinds import CausalBag, loss_of_each_alone, ragged_ids, ragged_test

    one = fit(CausalBag, ragged_ids(), ragged_test(), overrides={"run.dir": str(tmp_path / "one"),
                                                                **RAGGED_STREAM_OVERRIDES})
    both = _two_processes(two, "ragged_stream")
    assert one["steps"] == both["steps"] == 12 and one["test_count"] == both["test_count"] == 20
    assert max_relative_diff(load_weights(two[0] / "ragged_stream"), load_weights(tmp_path / "one")) < 1e-5
    expected = loss_of_each_alone(_trained(tmp_path / "one", CausalBag()), ragged_test())
    assert one["test_loss"] == pytest.approx(expected, rel=1e-5)
    assert both["test_loss"] == pytest.approx(one["test_loss"], rel=1e-5)
    assert one["train_loss"] < 0.95 * math.log(32)  # it learned something


@pytest.mark.timeout(900)
def test_a_dict_output_with_the_users_loss_and_metric_is_evaluated_exactly_at_world_sizes_1_and_2(task_root, two,
                                                                                                    tmp_path):
    """1,000 test samples in eval batches of 300 (the last of 100): every sample counted once, and the test loss is
    the user's loss over all of them, although len() of the model's output is 2."""
    from taskpkg.data import multitask
    from taskpkg.metrics import label_accuracy, multitask_loss
    from taskpkg.models import TwoHeads

    from distrib import fit

    train, (test_x, test_y) = multitask()
    fit(TwoHeads, train, (test_x, test_y), overrides={"run.dir": str(tmp_path / "one"), **MULTITASK_OVERRIDES},
        loss_fn=multitask_loss, metrics=[label_accuracy])
    folders = {"one": tmp_path / "one", "two": two[0] / "multitask"}
    assert max_relative_diff(load_weights(folders["two"]), load_weights(folders["one"])) < 1e-5
    for name, folder in folders.items():
        summary = _summary(folder)
        assert summary["world_size"] == (1 if name == "one" else 2)
        with torch.no_grad():  # from model.pt alone, on the whole test set in double precision
            outputs = _trained(folder, TwoHeads().double())(test_x.double())
        targets = {"label": test_y["label"], "value": test_y["value"].double()}
        assert summary["test_count"] == 1000, name
        assert summary["test_loss"] == pytest.approx(multitask_loss(outputs, targets).item(), rel=1e-5), name
        assert summary["test_label_accuracy"] == label_accuracy(outputs, targets)["label_accuracy"][0].item() / 1000


@pytest.mark.timeout(900)
def test_regression_with_mse_and_a_user_metric_at_world_sizes_1_and_2(task_root, two, tmp_path):
    from taskpkg.data import regression
    from taskpkg.models import regressor

    one = _one_process(tmp_path / "one", REGRESSION)
    folder, two = two[0] / "regression", _two_processes(two, "regression")
    assert max_relative_diff(load_weights(folder), load_weights(tmp_path / "one")) < 1e-5
    _, (test_x, test_y) = regression()
    with torch.no_grad():  # on the raw inputs: data.normalize = auto leaves features that are not images alone
        outputs = _trained(tmp_path / "one", regressor(6))(test_x).double()
    for summary in (one, two):
        assert summary["data"]["mean"] == [] and summary["data"]["targets"] == "float32 []"
        assert summary["test_loss"] == pytest.approx(F.mse_loss(outputs, test_y.double()).item(), rel=1e-5)
        assert summary["test_mae"] == pytest.approx((outputs - test_y).abs().mean().item(), rel=1e-5)
        assert not [key for key in summary if "accuracy" in key or "perplexity" in key]
    from distrib import cli

    assert cli.main(["eval", str(tmp_path / "one")]) == 0  # the trained model's task and metric, as in training
    evaluated = json.loads((tmp_path / "one" / "eval.json").read_text())
    assert (evaluated["test_loss"], evaluated["test_mae"]) == (one["test_loss"], one["test_mae"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", sorted(DENSE))
def test_dense_and_multi_label_targets_agree_at_world_sizes_1_and_2(task_root, two, tmp_path, task):
    from taskpkg import data, models

    one = _one_process(tmp_path / "one", DENSE[task])
    folder, two = two[0] / task, _two_processes(two, task)  # through the DataLoader at world size 2
    assert max_relative_diff(load_weights(folder), load_weights(tmp_path / "one")) < 1e-5
    (train_x, _), (test_x, test_y) = getattr(data, task)()
    if task == "segmentation":
        mean, std = (torch.tensor(one["data"][key]).view(1, -1, 1, 1) for key in ("mean", "std"))
        model, inputs = models.segmenter(3, 3), (test_x - mean) / std
        loss = lambda out: F.cross_entropy(out, test_y, ignore_index=-100)  # noqa: E731 - over counted pixels only
    else:
        model, inputs = models.tagger(10), test_x
        loss = lambda out: F.binary_cross_entropy_with_logits(out, test_y)  # noqa: E731
    with torch.no_grad():
        expected = loss(_trained(tmp_path / "one", model)(inputs).double()).item()
    for summary in (one, two):
        assert summary["test_loss"] == pytest.approx(expected, rel=1e-5)
        assert ("test_token_accuracy" in summary) == (task == "segmentation") and "test_accuracy" not in summary
    if task == "segmentation":
        assert one["test_token_count"] == two["test_token_count"] == (test_y != -100).sum().item()



RESUMED = {  # dict samples through the DataLoader path; masks with -100 on the device path, two micro-steps each
    "dict": [*BASE, "data.factory=taskpkg.data:dict_lm", "model.factory=taskpkg.models:dict_lm",
             "train.optimizer=adamw", "train.lr=0.003"],
    "segmentation": DENSE["segmentation"],
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", sorted(RESUMED))
def test_stop_mid_epoch_and_resume_is_bitwise(task_root, tmp_path, task):
    common = [*RESUMED[task], "train.schedule=constant", "train.grad_accum_steps=2"]
    _one_process(tmp_path / "whole", [*common, "train.max_steps=7"])
    _one_process(tmp_path / "parts", [*common, "train.max_steps=3"])  # 4 steps per epoch: stopped inside epoch 0
    resumed = _one_process(tmp_path / "parts", [*common, "train.max_steps=7"])
    assert resumed["resumed_from_step"] == 3 and resumed["epochs"] == 1
    whole, parts = load_weights(tmp_path / "whole"), load_weights(tmp_path / "parts")
    assert all(torch.equal(whole[key], parts[key]) for key in whole)
    assert resumed["test_loss"] == _summary(tmp_path / "whole")["test_loss"]


@pytest.mark.timeout(400)
def test_a_hugging_face_gpt2_on_dict_samples_at_world_size_1_and_under_fsdp(task_root, two, tmp_path):
    """transformers (a dev extra only): GPT2LMHeadModel from a tiny GPT2Config trains on its own loss."""
    from taskpkg.data import dict_lm
    from taskpkg.models import gpt2

    one = _one_process(tmp_path / "one", HF_GPT2)
    folder, two = two[0] / "hf_gpt2_fsdp", _two_processes(two, "hf_gpt2_fsdp")
    assert max_relative_diff(load_weights(folder), load_weights(tmp_path / "one")) < 1e-5
    _, test = dict_lm()
    with torch.no_grad():
        batch = {key: torch.stack([test[i][key] for i in range(len(test))]) for key in test[0]}
        model = gpt2()
        model.load_state_dict(load_weights(tmp_path / "one"))
        expected = model.eval()(**batch).loss.item()
    for summary in (one, two):
        assert summary["test_loss"] == pytest.approx(expected, rel=1e-5) and "test_perplexity" in summary
