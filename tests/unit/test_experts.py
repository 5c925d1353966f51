"""Models whose parameters get no gradient in some steps (experts, branches not taken) and models with extra outputs:
the probe of dist.find_unused_parameters = auto, the rule that no expert is an FSDP unit of its own, a user's loss
receiving the outputs whole, and the extra losses' share of a step (the world-size-2 runs: tests/integration)."""

import json
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from distrib import cli
from distrib.config import TrainConfig, load_config
from distrib.distributed.agreement import RankAgreement
from distrib.distributed.fsdp import find_blocks, leftover_units
from distrib.distributed.unused import experts_lists, find_unused, unreached
from distrib.errors import ConfigError
from distrib.launch.preempt import StopFlag
from distrib.metrics.tensorboard import _board_tag
from distrib.training.extra_losses import ExtraLosses, extra_names
from distrib.training.losses import build_loss, step_loss
from tests.helpers.moe import Expert, MoELM, moe_lm
from tests.helpers.support import SMALL, sets

MOE = ["data.factory=tests.helpers.moe:tokens", "model.factory=tests.helpers.moe:moe_lm", "train.max_steps=3",
       "train.global_batch_size=16", "train.optimizer=adamw", "train.lr=0.01", "train.log_every=1",
       "train.epochs=0"]


class Branchy(nn.Module):
    """A branch the first batch does not take (its parameters unreached), and no experts list."""

    def __init__(self):
        super().__init__()
        self.used, self.skipped = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x) if x.sum() > -1e9 else self.skipped(x)


class TopLevelExperts(nn.Module):
    """Experts straight under the root, each a large share of the parameters."""

    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(8, 4), nn.ModuleList(Expert(8) for _ in range(4))


def _batch():
    return torch.randint(0, 32, (2, 16))


def test_auto_turns_find_unused_on_for_experts_or_an_unreached_parameter_and_says_why():
    said = []
    assert experts_lists(moe_lm()) == ["blocks.0.moe.experts", "blocks.1.moe.experts"]
    assert find_unused("auto", moe_lm(), None, torch.device("cpu"), said.append)
    assert "on, since the model has experts (blocks.0.moe.experts, blocks.1.moe.experts)" in said[-1]

    branchy, x = Branchy(), torch.randn(2, 4)
    assert unreached(branchy, lambda model: model(x)) == ["skipped.weight", "skipped.bias"]
    assert branchy.training  # probed in eval mode, given back as it was
    assert find_unused("auto", branchy, lambda model: model(x), torch.device("cpu"), said.append)
    assert "the first batch left the parameter skipped.weight and 1 more without a gradient" in said[-1]

    reached = nn.Linear(4, 2)
    assert not find_unused("auto", reached, lambda model: {"out": model(x), "ids": x.long()}, torch.device("cpu"),
                           said.append)
    assert len(said) == 2  # off: no line
    assert find_unused(True, reached, None, torch.device("cpu"), said.append)
    assert not find_unused(False, branchy, None, torch.device("cpu"), said.append)


def test_a_probe_that_raises_decides_nothing_and_the_dry_batch_says_the_users_error(tmp_path, capsys):
    def broken(model):
        raise ValueError("shapes do not fit")

    assert unreached(Branchy(), broken) == []  # no crash here: the dry batch after it reports the error
    wrong = ["data.factory=tests.helpers.moe:tokens", "model.factory=tests.helpers.factories:network"]
    assert cli.main(["train", *sets(*SMALL, *wrong, f"run.dir={tmp_path}")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "the model cannot take the data's inputs" in err[-1] and "Traceback" not in "".join(err)


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("true", True), ("false", False)])
def test_the_key_takes_auto_true_or_false(value, expected):
    assert load_config(None, [f"dist.find_unused_parameters={value}"]).dist.find_unused_parameters == expected


def test_the_key_refuses_other_words():
    with pytest.raises(ConfigError, match=r"dist.find_unused_parameters = 'yes': must be auto, true or false"):
        load_config(None, ["dist.find_unused_parameters=yes"])


def test_no_expert_is_an_fsdp_unit_of_its_own():
    model = MoELM()
    blocks = find_blocks(model, "auto")
    assert model.blocks[0] in blocks and model.blocks[1] in blocks  # the layers that hold the experts
    inside = {id(m) for block in model.blocks for m in block.moe.experts.modules()}
    assert not any(id(m) in inside for m in blocks + leftover_units(model, blocks))

    top = TopLevelExperts()  # before, each expert was a block and each of its Linears a leftover unit
    blocks = find_blocks(top, "auto")
    assert blocks == [top.router] and leftover_units(top, blocks) == []
    for named in (("Expert",), ("Linear",)):
        with pytest.raises(ConfigError, match=re.escape(f"dist.shard_modules = {named!r}: ") + r"\w+ modules sit in "
                           r"the model's experts lists \(blocks.0.moe.experts, blocks.1.moe.experts\).*use auto"):
            find_blocks(model, named)


def test_a_users_loss_receives_the_outputs_whole():
    seen = []

    def loss_fn(outputs, targets):
        seen.append(outputs)
        return outputs["logits"].sum() * 0 if isinstance(outputs, dict) else outputs.sum() * 0

    loss, targets = build_loss(TrainConfig(), loss_fn), torch.zeros(2, dtype=torch.long)
    as_dict = {"logits": torch.randn(2, 3), "aux_loss": torch.tensor(0.5)}
    tensor = torch.randn(2, 3)
    loss(as_dict, targets), loss(tensor, targets)
    assert seen[0] is as_dict and seen[1] is tensor
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    output = MoeCausalLMOutputWithPast(logits=torch.randn(2, 3), aux_loss=torch.tensor(0.1))
    loss(output, targets)
    assert seen[2] is output
    builtin = build_loss(TrainConfig())  # a built-in takes the logits
    assert builtin(as_dict, targets) == builtin(as_dict["logits"], targets)


def test_extra_losses_are_the_scalar_keys_ending_in_loss():
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    scalar = torch.tensor(0.1)
    assert extra_names({"logits": scalar, "aux_loss": scalar, "loss": scalar, "z_loss": scalar,
                        "token_loss": torch.ones(3), "ids_loss": torch.tensor(1)}) == ("aux_loss", "z_loss")
    assert extra_names(MoeCausalLMOutputWithPast(loss=scalar, aux_loss=scalar, logits=scalar)) == ("aux_loss",)
    assert extra_names(SimpleNamespace(loss=scalar, balance_loss=scalar)) == ("balance_loss",)
    assert extra_names(torch.ones(2)) == extra_names((scalar, scalar)) == ()


def _step_extras(aux_values: list[float], added: bool) -> tuple[ExtraLosses, list[torch.Tensor]]:
    """One rank's step over len(aux_values) micro-batches of a dict-output model under the built-in loss."""
    extras, loss = ExtraLosses(("aux_loss",), added), build_loss(TrainConfig(loss="mse"))
    targets = [torch.zeros(2, 3) for _ in aux_values]
    extras.start(torch.device("cpu"))
    piece = step_loss(loss, targets, 1, extras)
    backwarded = [piece({"logits": torch.ones(2, 3), "aux_loss": torch.tensor(value)}, target, 1)
                  for value, target in zip(aux_values, targets)]
    return extras, backwarded


def test_extra_losses_are_normalised_as_batch_means_and_agreed_once(monkeypatch):
    one, backwarded = _step_extras([0.2, 0.6], added=True)  # world 1, 2 micro-batches
    assert one.sums.tolist() == pytest.approx([0.4])  # their mean
    assert [value.item() for value in backwarded] == pytest.approx([(1 + 0.2) / 2, (1 + 0.6) / 2])
    _, only_logged = _step_extras([0.2, 0.6], added=False)
    assert [value.item() for value in only_logged] == pytest.approx([0.5, 0.5])
    # World 2, one micro-batch each: the agreement's one all-reduce sums the ranks' shares, then divides by them.
    ranks = [_step_extras([value], added=True)[0].sums for value in (0.2, 0.6)]
    monkeypatch.setattr("torch.distributed.all_reduce", lambda votes: votes.copy_(
        torch.cat([votes[:3] * 2, ranks[0] + ranks[1]])))
    agreement = RankAgreement(StopFlag(), torch.device("cpu"), 2)
    agreed = agreement.agree(torch.tensor(1.0), 1, ranks[0])
    assert agreed.extras.tolist() == pytest.approx(one.sums.tolist()) and agreed.loss.item() == pytest.approx(1.0)


def test_a_moe_run_logs_its_aux_loss_every_step_and_adds_it_to_the_builtin_loss(tmp_path, capsys):
    assert cli.main(["train", *sets(*SMALL, *MOE, f"run.dir={tmp_path}")]) == 0
    err = capsys.readouterr().err
    assert "dist.find_unused_parameters = auto: on, since the model has experts" in err
    assert "training loss = cross_entropy + aux_loss" in err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "loss" in record and "lr" in record]
    assert [record["step"] for record in steps] == [1, 2, 3]
    assert all(0 < record["aux_loss"] < record["loss"] for record in steps)
    assert _board_tag("aux_loss") == "train/aux_loss"


def test_ddp_without_find_unused_is_one_line_naming_the_key(tmp_path, capsys):
    argv = ["train", *sets(*SMALL, *MOE, "dist.find_unused_parameters=false", f"run.dir={tmp_path}")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("distrib: error: dist.find_unused_parameters = false: a trainable parameter got no "
                              "gradient in the previous step")
    assert err[-1].endswith("fix: --set dist.find_unused_parameters=true") and "Traceback" not in "".join(err)


FIT = {"train.max_steps": 2, "train.epochs": 0, "train.global_batch_size": 16, "train.log_every": 1,
       "run.progress": False, "dist.device": "cpu", "checkpoint.every_steps": 0}


def test_a_models_own_loss_is_trained_as_it_is_and_a_users_function_decides(tmp_path, capsys):
    from distrib import fit
    from tests.helpers.moe import MoEWithLoss, token_dicts

    fit(MoEWithLoss, *token_dicts(), overrides={**FIT, "run.dir": str(tmp_path / "own")})
    err = capsys.readouterr().err
    assert "aux_loss: logged on its own; the model's own outputs.loss is trained as it is" in err
    assert "loss: the model's own outputs.loss" in err and "training loss =" not in err
    assert "aux_loss" in (tmp_path / "own" / "metrics.jsonl").read_text()

    given = []

    def next_token_only(outputs, targets):  # receives the outputs whole, the model's loss among them
        given.append(sorted(outputs))
        logits = outputs["logits"][:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1))

    fit(MoEWithLoss, *token_dicts(), overrides={**FIT, "run.dir": str(tmp_path / "user")}, loss_fn=next_token_only)
    err = capsys.readouterr().err
    assert "aux_loss: logged on its own; train.loss 'next_token_only' receives the outputs whole and decides" in err
    assert given and all(keys == ["aux_loss", "logits", "loss"] for keys in given)
