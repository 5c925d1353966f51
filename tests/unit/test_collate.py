"""Samples of different lengths in process: ragged dict samples right-padded per micro-batch (input_ids with
data.pad_id, attention_mask 0, labels -100), the user's collate function (a Hugging Face data collator) through
data.collate and fit(collate_fn=...), and a model's own loss counted by the labels' positions, so that how long a
micro-batch is padded does not change a sample's share of the loss."""

import pytest
import torch
from torch.utils.data import Dataset

from distrib.config import load_config
from distrib.data import data_from_datasets
from distrib.data.batching import Failed
from distrib.data.collate import Collate, collate_for, pad
from distrib.distributed.runtime import Runtime
from distrib.errors import ConfigError, UserError
from distrib.training.evaluation import _loss_sum
from distrib.training.losses import CountedModelLoss, Loss, model_loss

CPU = Runtime(0, 0, 1, 1, torch.device("cpu"), backend="none")


class Ragged(Dataset):
    """Token samples of 8 to 32 ids, labels = input_ids (a causal LM shifts them itself)."""

    def __init__(self, num_samples: int, seed: int = 0, vocab_size: int = 50):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(8, 33, (num_samples,), generator=g).tolist()
        self.ids = [torch.randint(1, vocab_size, (n,), generator=g) for n in lengths]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


class Unlabelled(Ragged):
    def __getitem__(self, index):
        return {"input_ids": self.ids[index]}


def test_ragged_dict_samples_are_right_padded_per_micro_batch():
    samples = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, 6, 7])},
               {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])}]
    inputs, targets = Collate(pad_id=3, padded=True)(samples)
    assert targets is None  # the labels stay in the dict
    assert inputs["input_ids"].tolist() == [[5, 6, 7], [8, 3, 3]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert inputs["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    given = pad([{"input_ids": torch.tensor([1]), "attention_mask": torch.tensor([1]), "extra": torch.tensor([4])},
                 {"input_ids": torch.tensor([1, 2]), "attention_mask": torch.tensor([1, 1]),
                  "extra": torch.tensor([4, 4])}])
    assert given[0]["attention_mask"].tolist() == [1, 0] and given[0]["extra"].tolist() == [4, 0]
    same = [{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3, 4])}]
    assert Collate()(same)[0].keys() == {"input_ids"}  # one length: stacked as it is


def test_a_hugging_face_collator_makes_the_batches_and_a_broken_one_is_one_line():
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, **{f"w{i}": i for i in range(1, 50)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w1")),
                                        pad_token="[PAD]")
    hf = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    train = Unlabelled(12)
    config = load_config(None, ["data.loader=dataloader"]).data
    data = data_from_datasets(train, Unlabelled(5, seed=1), config, CPU, seed=0, log=lambda m: None, collate_fn=hf)
    (inputs, targets), = data.train.batches([torch.tensor([0, 3, 4])])
    longest = max(len(train.ids[i]) for i in (0, 3, 4))
    assert inputs["input_ids"].shape == (3, longest) and targets is inputs["labels"]
    assert (inputs["labels"][inputs["attention_mask"] == 0] == -100).all()

    config = load_config(None, ["data.collate=tests.helpers.data_factories:pad_to_32"]).data
    data = data_from_datasets(Ragged(8), Ragged(3, seed=1), config, CPU, seed=0, log=lambda m: None)
    (inputs, targets), = data.train.batches([torch.tensor([1, 2])])
    assert inputs["input_ids"].shape == (2, 32) and (targets[0, len(Ragged(8).ids[1]):] == -100).all()

    broken = Collate(user=lambda batch: 1 / 0, where="data.collate = 'pkg.mod:fn'")([train[0], train[1]])
    assert isinstance(broken, Failed) and broken.message.startswith(
        "data.collate = 'pkg.mod:fn': raised ZeroDivisionError: division by zero on a batch of 2 samples")
    assert "returned str" in Collate(user=lambda batch: "x")([train[0], train[1]]).message
    with pytest.raises(UserError, match=r"data.collate = 'tests.helpers.nowhere:fn': cannot import"):
        collate_for(0, "tests.helpers.nowhere:fn")
    with pytest.raises(ConfigError, match=r"data.collate = 'pad': must look like package.module:function"):
        load_config(None, ["data.collate=pad"])


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)).eval()


def test_a_causal_models_own_loss_is_counted_by_positions_whatever_the_padding():
    model, dataset, collate = _tiny_gpt2(), Ragged(6), Collate(padded=True)
    batch, _ = collate([dataset[i] for i in range(6)])
    with torch.no_grad():
        outputs = model(**batch)
    loss = model_loss(outputs, batch["labels"])
    assert isinstance(loss, CountedModelLoss) and loss.shift  # GPT-2 shifts its labels
    assert int(loss.count(batch["labels"])) == sum(len(dataset.ids[i]) - 1 for i in range(6))
    # The same samples as two micro-batches, each padded to its own longest: the sums agree with the whole batch's.
    halves = []
    for part in ([0, 1, 2], [3, 4, 5]):
        half, _ = collate([dataset[i] for i in part])
        with torch.no_grad():
            halves.append(loss.total(model(**half), half["labels"]))
    assert torch.allclose(sum(halves), loss.total(outputs, batch["labels"]), rtol=1e-5)
    fixed, count = _loss_sum(loss, outputs, batch["labels"], 6)
    assert fixed / 2**32 / int(count) == pytest.approx(outputs.loss.item(), rel=1e-6)
    assert type(model_loss(outputs, torch.zeros(6, 3))) is Loss  # float targets: not a cross-entropy, a batch mean
