"""The task rules in one process, no training: what a sample may be, the losses over positions against PyTorch's,
the global count that weights micro-batches, optimizer groups and the user's optimizer, and the task's log lines."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distrib.config import load_config
from distrib.data import samples
from distrib.data.batching import collate
from distrib.data.factory import as_split_or_dataset
from distrib.errors import UserError
from distrib.training.evaluation import task_of, user_metric
from distrib.training.losses import build_loss, class_dim, global_count_scale, model_loss
from distrib.training.notes import optimizer_note, task_notes
from distrib.training.optimizers import build_optimizer


def _train(*overrides):
    return load_config(None, list(overrides)).train


def test_samples_of_any_structure_become_one_batch():
    ids = torch.arange(12).view(3, 4)
    dicts = [{"input_ids": row, "labels": row} for row in ids]
    inputs, targets = collate(dicts)
    assert targets is None and torch.equal(inputs["input_ids"], ids)
    assert torch.equal(samples.resolve(inputs, targets)[1], ids)  # a dict sample's targets are its labels
    pairs = [(row.float(), 1.5) for row in ids]  # float features and a float target
    inputs, targets = collate(pairs)
    assert inputs.dtype == torch.float32 and targets.dtype == torch.float32 and targets.shape == (3,)
    mixed = collate([(torch.zeros(4), 0), (torch.zeros(5), 0)])
    assert "different shapes" in mixed.message
    split = as_split_or_dataset((ids, {"a": ids, "b": ids[:, 0]}), "train")
    assert samples.kind(split.targets) == "{a: int64 [4], b: int64 []}"
    with pytest.raises(UserError, match="3 inputs and 2 targets"):
        as_split_or_dataset((ids, ids[:2]), "train")


def test_cross_entropy_over_positions_matches_pytorch_in_both_layouts():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    targets[0, :3] = -100
    loss = build_loss(_train())
    expected = F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), ignore_index=-100)
    assert loss(logits, targets) == expected  # [B, T, C], the preferred layout
    assert torch.allclose(loss(logits.movedim(-1, 1), targets), expected)  # [B, C, T], PyTorch's
    assert loss.count(targets) == 7 and torch.allclose(loss.total(logits, targets) / 7, expected)
    assert class_dim(torch.zeros(2, 10), targets) is None  # [B, 10] for [B, T]: does not pair
    assert class_dim(torch.zeros(2, 10), targets[:, 0]) == 1


def test_the_global_count_weights_micro_batches_by_what_they_count():
    loss = build_loss(_train())
    targets = [torch.tensor([[1, -100, -100]]), torch.tensor([[1, 2, 0]])]
    assert global_count_scale(loss, targets, shares=1).item() == pytest.approx(1 / 4)
    assert global_count_scale(loss, [t[:, 0] for t in targets], shares=1) is None  # one class per sample
    assert global_count_scale(build_loss(_train("train.loss=mse")), targets, shares=1) is None


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Embedding(10, 4), nn.LayerNorm(4)
        self.linear, self.drop = nn.Linear(4, 10), nn.Dropout(0.1)

    def forward(self, x):
        return self.linear(self.drop(self.norm(self.embed(x))))


def test_adamw_groups_leave_biases_norms_and_embeddings_undecayed_and_say_so():
    lines = []
    optimizer = build_optimizer(_Net(), _train("train.optimizer=adamw", "train.weight_decay=0.1",
                                               "train.betas=[0.8,0.9]"), lines.append)
    decayed, kept = optimizer.param_groups
    assert [p.shape for p in decayed["params"]] == [torch.Size([10, 4])] and decayed["weight_decay"] == 0.1
    assert len(kept["params"]) == 4 and kept["weight_decay"] == 0.0 and decayed["betas"] == (0.8, 0.9)
    assert len(lines) == 1 and "none on 4 biases, norms and embeddings" in lines[0]
    everything = build_optimizer(_Net(), _train("train.optimizer=adamw", "train.weight_decay=0.1", "train.decay=all"))
    assert len(everything.param_groups) == 1


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_the_built_in_optimizers_run_foreach_and_step_bitwise_as_the_per_parameter_loop(optimizer):
    """foreach (one op over all parameters) is a speed choice only: the same bits as torch's CPU default."""
    config = _train(f"train.optimizer={optimizer}", "train.weight_decay=0.1", "train.lr=0.01")
    torch.manual_seed(0)
    fast, plain = _Net(), _Net()
    plain.load_state_dict(fast.state_dict())
    fast_opt, plain_opt = build_optimizer(fast, config), build_optimizer(plain, config)
    assert all(group["foreach"] for group in fast_opt.param_groups)
    for group in plain_opt.param_groups:
        group["foreach"] = False
    x = torch.randint(0, 10, (8, 3))
    for _ in range(3):
        for model, opt in ((fast, fast_opt), (plain, plain_opt)):
            model.eval()  # no dropout draws: both see the same function
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(fast.parameters(), plain.parameters()))


def test_a_users_optimizer_gets_the_groups_and_the_config(tmp_path, monkeypatch):
    (tmp_path / "myopt.py").write_text("import torch\n\ndef lion_like(groups, config):\n"
                                       "    return torch.optim.SGD(groups, lr=config.lr * 2)\n\n"
                                       "def not_one(groups, config):\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    optimizer = build_optimizer(_Net(), _train("train.optimizer=myopt:lion_like", "train.lr=0.5"))
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 1.0
    with pytest.raises(UserError, match="returned int, not a torch.optim.Optimizer"):
        build_optimizer(_Net(), _train("train.optimizer=myopt:not_one"))


def test_the_task_decides_the_metrics_and_the_log_says_which():
    loss = build_loss(_train())
    assert task_of(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), loss).kind == "classes"
    dense = task_of(torch.zeros(4, 6, 3), torch.zeros(4, 6, dtype=torch.long), loss)
    assert (dense.kind, dense.sequence) == ("positions", True)
    own = task_of(torch.zeros(4, 6, 3), torch.zeros(4, 6, dtype=torch.long), model_loss())
    assert (own.kind, own.sequence) == ("values", True)  # its logits may be shifted against its labels
    assert task_of(torch.zeros(4), torch.zeros(4), build_loss(_train("train.loss=mse"))).kind == "values"
    notes = task_notes(_train("train.warmup_steps=20"), loss, dense, _Net(), total_steps=12)
    assert notes[0] == "loss: train.loss = cross_entropy; metrics: test_loss, test_token_accuracy, test_perplexity"
    assert notes[1] == "optimizer sgd (momentum 0.9), lr 0.05, cosine to 0 over 0 steps after 20 warm-up steps"
    assert "1 dropout layers (drop, ...)" in notes[2] and "differ between world sizes" in notes[2]
    assert notes[3].startswith("train.warmup_steps = 20 is longer than this run's 12 steps")


def test_the_log_names_the_optimizer_schedule_and_warm_up():
    def said(*overrides: str, total_steps: int | None = 500) -> str:
        return optimizer_note(_train(*overrides), total_steps)
    assert said() == "optimizer sgd (momentum 0.9), lr 0.05, cosine to 0 over 400 steps after 100 warm-up steps"
    assert said("train.optimizer=adamw", "train.betas=[0.9,0.95]", "train.weight_decay=0.1", "train.lr=3e-4",
                "train.schedule=constant", "train.warmup_steps=0", "train.grad_clip=1") == \
        "optimizer adamw (betas 0.9, 0.95, weight decay 0.1), lr 0.0003, constant without warm-up, gradient norm " \
        "clipped at 1"
    assert said("train.schedule_steps=1000").endswith("cosine to 0 over 900 steps after 100 warm-up steps")
    assert said(total_steps=None).endswith("cosine to 0 at the end after 100 warm-up steps")  # a stream's passes
    assert said("train.optimizer=myopt:lion_like") == "optimizer myopt:lion_like (your function: its learning rate " \
        "is the peak), cosine to 0 over 400 steps after 100 warm-up steps"


def test_the_log_promises_top5_accuracy_only_where_the_summary_has_it():
    loss, targets = build_loss(_train()), torch.zeros(4, dtype=torch.long)
    four, ten = task_of(torch.zeros(4, 4), targets, loss), task_of(torch.zeros(4, 10), targets, loss)
    assert task_notes(_train(), loss, four, _Net(), 12)[0].endswith("metrics: test_loss, test_accuracy")
    assert task_notes(_train(), loss, ten, _Net(), 12)[0].endswith("metrics: test_loss, test_accuracy, "
                                                                   "test_top5_accuracy")
    with pytest.raises(UserError, match="this run reports no test_top5_accuracy"):
        four.check_watched("train.early_stop_metric", "test_top5_accuracy")


def test_a_user_metric_must_return_sums_and_counts():
    metric = user_metric("m:ok", lambda out, y: {"mae": ((out - y).abs().sum(), y.numel())}, torch.ones(3),
                         torch.zeros(3))
    assert metric.names == ("mae",)
    with pytest.raises(UserError, match=r"return \{name: \(sum, count\)\}"):
        user_metric("m:bad", lambda out, y: (out - y).abs().mean(), torch.ones(3), torch.zeros(3))


def test_early_stopping_and_best_k_must_watch_a_metric_the_task_reports():
    regression = task_of(torch.zeros(4), torch.zeros(4), build_loss(_train("train.loss=mse")))
    regression.check_watched("train.early_stop_metric", "test_loss_ema")
    with pytest.raises(UserError, match="train.early_stop_metric = 'test_accuracy': this run reports no test_accuracy"):
        regression.check_watched("train.early_stop_metric", "test_accuracy")


class _Source:
    """A batch source of one dict batch, whose attention mask was left on another device."""

    num_samples = 2

    def batches(self, index_lists, epoch=None):
        ids = torch.zeros(2, 4, dtype=torch.long)
        yield {"input_ids": ids, "attention_mask": torch.ones(2, 4, device="meta"), "labels": ids}, ids


def test_the_dry_batch_names_a_misplaced_tensor_of_a_dict_sample():
    from distrib.data import DataInfo
    from distrib.errors import DeviceMismatchError
    from distrib.training.preflight import dry_batch

    info = DataInfo("dicts", (), 4, (), (), ())
    with pytest.raises(DeviceMismatchError, match="batch tensor inputs.attention_mask is on meta"):
        dry_batch(_Net(), _Source(), info, torch.device("cpu"), build_loss(_train()))


def test_a_dict_sample_with_a_column_that_is_not_a_tensor_is_one_line_naming_it():
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return {"input_ids": torch.zeros(4, dtype=torch.long), "text": "hello"}

    with pytest.raises(UserError, match="dicts whose 'text' is a str, not a tensor"):
        as_split_or_dataset(Rows(), "train data")
