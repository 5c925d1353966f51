"""A user's own code for tasks other than image classification, written OUTSIDE the project (into a temp dir that the
test puts on PYTHONPATH): a byte-level GPT on int64 [N, T] pairs, a dict-sample language model that returns its own
loss, a float regression with a metric, segmentation and multi-label data, and pairings that are wrong on purpose."""

from __future__ import annotations

import textwrap
from pathlib import Path

DATA = '''
import torch
from torch.utils.data import Dataset

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "far", "away", "home")


def text_bytes(num_bytes, seed=0):
    """Deterministic English-like text as uint8 bytes."""
    g = torch.Generator().manual_seed(seed)
    words = [WORDS[i] for i in torch.randint(0, len(WORDS), (num_bytes // 3,), generator=g).tolist()]
    return torch.tensor(list(" ".join(words).encode()[:num_bytes]), dtype=torch.uint8)


def windows(data, seq_len):
    """Non-overlapping windows: inputs [N, T] and the next bytes as targets [N, T], both int64."""
    n = (len(data) - 1) // seq_len
    x = data[:n * seq_len].long().view(n, seq_len)
    y = data[1:n * seq_len + 1].long().view(n, seq_len)
    return x, y


def bytes_lm(num_train=96, num_test=40, seq_len=16):
    data = text_bytes((num_train + num_test) * seq_len + 1)
    x, y = windows(data, seq_len)
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


class TokenDicts(Dataset):
    """Samples as a tokenized Hugging Face dataset gives them: {"input_ids", "attention_mask", "labels"}."""

    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def dict_lm(num_train=64, num_test=24, seq_len=16):
    data = text_bytes((num_train + num_test) * seq_len + 1, seed=1)
    x, _ = windows(data, seq_len)
    return TokenDicts(x[:num_train]), TokenDicts(x[num_train:])


class Unexpected(TokenDicts):
    def __getitem__(self, index):
        return {**super().__getitem__(index), "token_type_ids": torch.zeros_like(self.ids[index])}


class Unlabelled(TokenDicts):
    def __getitem__(self, index):
        return {"input_ids": self.ids[index]}


def dict_lm_no_labels():
    train, test = dict_lm()
    return Unlabelled(train.ids), Unlabelled(test.ids)


def dict_lm_extra_key():
    train, test = dict_lm()
    return Unexpected(train.ids), Unexpected(test.ids)


def regression(num_train=192, num_test=64, features=6):
    """Float features far from unit scale and a float target [N]: data.normalize = auto must leave both alone."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(features, generator=g)
    x = 5.0 + 3.0 * torch.randn(num_train + num_test, features, generator=g)
    y = x @ w + 0.1 * torch.randn(num_train + num_test, generator=g)
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


def float_tokens():
    """Token ids as floats: wrong for a model that embeds them."""
    (x, y), (tx, ty) = bytes_lm()
    return (x.float(), y), (tx.float(), ty)


def segmentation(num_train=64, num_test=24, size=8, num_classes=3):
    """Images [N, 3, H, W] and masks [N, H, W] of 0..num_classes-1, with -100 (not counted) on a random share of
    pixels, so micro-batches count different numbers of positions."""
    g = torch.Generator().manual_seed(4)
    n = num_train + num_test
    masks = torch.randint(0, num_classes, (n, size, size), generator=g)
    images = torch.nn.functional.one_hot(masks, num_classes).permute(0, 3, 1, 2).float()
    images = images + 0.5 * torch.randn(n, num_classes, size, size, generator=g)
    masks[torch.rand(n, size, size, generator=g) < torch.rand(n, 1, 1, generator=g) * 0.6] = -100
    return (images[:num_train], masks[:num_train]), (images[num_train:], masks[num_train:])


def multitask(num_train=128, num_test=1000, features=8):
    """Features [N, 8] and dict targets {"label": one of 4 classes, "value": [1] float}: a two-headed model's data."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(num_train + num_test, features, generator=g)
    targets = {"label": x[:, :4].argmax(1), "value": x[:, 4:].sum(1, keepdim=True)}
    train = {key: value[:num_train] for key, value in targets.items()}
    return (x[:num_train], train), (x[num_train:], {key: value[num_train:] for key, value in targets.items()})


class RaggedTokens(Dataset):
    """Tokenized texts of 8 to 32 ids each, unpadded, as a tokenizer gives them: {"input_ids", "labels"} of the
    text's own length (a causal LM shifts the labels itself)."""

    def __init__(self, num_samples, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(8, 33, (num_samples,), generator=g).tolist()
        self.ids = list(text_bytes(sum(lengths), seed=seed).long().split(lengths))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index].clone()}


def ragged_lm(num_train=96, num_test=40):
    return RaggedTokens(num_train, seed=6), RaggedTokens(num_test, seed=7)


def multilabel(num_train=128, num_test=48, features=10, labels=5):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(num_train + num_test, features, generator=g)
    y = (x[:, :labels] + 0.3 * torch.randn(num_train + num_test, labels, generator=g) > 0).float()
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])
'''

MODELS = '''
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; no dropout (its masks would differ between world sizes). No qkv bias:
    the key bias's true gradient is zero (softmax ignores a constant per row), so Adam would scale its rounding noise,
    which differs between world sizes, up to full steps."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size=256, seq_len=16, dim=32, n_layers=2, n_heads=2):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab_size, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # [B, T, vocab]


def gpt(seq_len, dim=32):
    return TinyGPT(256, seq_len, dim)


class DictLM(nn.Module):
    """A Hugging Face-style causal LM: forward(input_ids, attention_mask, labels) returns an object with .loss (the
    next-token cross-entropy, labels shifted inside) and .logits."""

    def __init__(self, vocab_size=256, dim=32):
        super().__init__()
        self.gpt = TinyGPT(vocab_size, 16, dim, n_layers=1)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.gpt(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def dict_lm():
    return DictLM()


def regressor(in_features):
    return nn.Sequential(nn.Linear(in_features, 16), nn.Tanh(), nn.Linear(16, 1), nn.Flatten(0))


def segmenter(in_channels, num_classes):
    """[B, C, H, W] logits (PyTorch's layout) for [B, H, W] masks."""
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, num_classes, 1))


def tagger(in_features, labels=5):
    return nn.Sequential(nn.Linear(in_features, 16), nn.ReLU(), nn.Linear(16, labels))


class TwoHeads(nn.Module):
    """A multi-task model: a dict of class logits [B, 4] and a value [B, 1] (len() of its output is 2)."""

    def __init__(self, features=8):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 16), nn.Tanh())
        self.cls, self.reg = nn.Linear(16, 4), nn.Linear(16, 1)

    def forward(self, x):
        hidden = self.body(x)
        return {"cls": self.cls(hidden), "reg": self.reg(hidden)}


def gpt2(vocab_size=256, seq_len=16):
    """A Hugging Face GPT-2 from a tiny config: nothing downloaded, no dropout (world sizes must agree)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def ten_outputs(seq_len):
    """[B, 10] for [B, T] targets: one logit vector per sequence, not per position."""
    return nn.Sequential(nn.Embedding(256, 8), nn.Flatten(), nn.Linear(8 * seq_len, 10))
'''

METRICS = '''
import torch.nn.functional as F


def mae(outputs, targets):
    """Mean absolute error as (sum, count): summed exactly over the whole test set by distrib."""
    errors = (outputs - targets).abs()
    return {"mae": (errors.sum(), errors.numel())}


def multitask_loss(outputs, targets):
    """The two heads' batch means, added: cross-entropy of the classes, mse of the values."""
    return (F.cross_entropy(outputs["cls"], targets["label"])
            + F.mse_loss(outputs["reg"], targets["value"]))


def label_accuracy(outputs, targets):
    right = outputs["cls"].argmax(1) == targets["label"]
    return {"label_accuracy": (right.sum(), right.numel())}


def next_token_accuracy(logits, labels):
    """A causal LM's own accuracy: logits at t predict labels at t + 1."""
    right = logits[:, :-1].argmax(-1) == labels[:, 1:]
    return {"next_token_accuracy": (right.sum(), right.numel())}
'''


def write_task_package(root: Path) -> Path:
    """root/taskpkg/{data,models,metrics}.py; returns root, for PYTHONPATH."""
    package = Path(root) / "taskpkg"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    for name, text in (("data", DATA), ("models", MODELS), ("metrics", METRICS)):
        (package / f"{name}.py").write_text(textwrap.dedent(text).lstrip())
    return Path(root)
