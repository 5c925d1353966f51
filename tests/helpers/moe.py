"""A user's tiny mixture-of-experts language model and its token data (`model.factory = tests.helpers.moe:moe_lm`,
`data.factory = tests.helpers.moe:tokens`): 4 experts per layer, top-1 routing, one expert all but dead.

Each layer's router starts with a bias against its last expert (DEAD_BIAS): in the first layer it gets a few tokens of
some micro-batches and none of others, in the second none at all, so its parameters get no gradient in some steps, on
some ranks or on all. The model returns {"logits", "aux_loss"}: a load-balancing loss over each micro-batch's routing
statistics (Switch Transformer's). No dropout, so that runs at any world size agree."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ_LEN, NUM_EXPERTS = 32, 16, 4
DEAD_BIAS = -0.9  # at the start, 0-3 of a micro-batch's 128 tokens in the first layer, none in the second
AUX_COEF = 0.01


def tokens(num_train: int = 128, num_test: int = 32):
    """A learnable stream (a noisy counter modulo VOCAB) cut into [N, SEQ_LEN] int64 inputs and next-token targets."""
    g = torch.Generator().manual_seed(0)
    count = (num_train + num_test) * SEQ_LEN + 1
    stream = (torch.arange(count) + torch.randint(0, 3, (count,), generator=g)) % VOCAB
    x, y = stream[:-1].view(-1, SEQ_LEN), stream[1:].view(-1, SEQ_LEN)
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


class Expert(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-1 routing: each token goes through the one expert of highest router probability, scaled by it."""

    def __init__(self, dim: int):
        super().__init__()
        self.router = nn.Linear(dim, NUM_EXPERTS)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(NUM_EXPERTS))
        with torch.no_grad():
            self.router.bias[-1] = DEAD_BIAS

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            routed = choice == index
            if routed.any():  # an expert that gets no token does not run: no gradient for its parameters
                out = out.index_put((routed,), expert(flat[routed]) * probs[routed, index, None])
        fraction = F.one_hot(choice, NUM_EXPERTS).float().mean(0)
        aux = NUM_EXPERTS * (fraction * probs.mean(0)).sum()  # over this micro-batch's tokens
        return out.view_as(x), aux


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int = 2):
        super().__init__()
        self.n_heads = n_heads
        self.norm1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2, self.moe = nn.LayerNorm(dim), MoE(dim)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(dim, -1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        moved, aux = self.moe(self.norm2(x))
        return x + moved, aux


class MoELM(nn.Module):
    def __init__(self, vocab_size: int = VOCAB, seq_len: int = SEQ_LEN, dim: int = 16, n_layers: int = 2):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab_size, dim), nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        aux = []
        for block in self.blocks:
            x, layer_aux = block(x)
            aux.append(layer_aux)
        return {"logits": self.head(self.norm(x)), "aux_loss": AUX_COEF * torch.stack(aux).mean()}


def moe_lm(vocab_size: int = VOCAB, seq_len: int = SEQ_LEN) -> MoELM:
    return MoELM(vocab_size, seq_len)


class MoEWithLoss(MoELM):
    """The same model as a Hugging Face MoE returns it: its own next-token loss plus its aux loss, for dict samples."""

    def forward(self, input_ids, labels=None):
        outputs = super().forward(input_ids)
        if labels is not None:
            logits = outputs["logits"][:, :-1]
            outputs["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)) \
                + outputs["aux_loss"]
        return outputs


def token_dicts(num_train: int = 64, num_test: int = 16) -> tuple[list, list]:
    """tokens() as dict samples, {"input_ids", "labels"}, as a tokenized Hugging Face dataset gives them."""
    (x, _), (test_x, _) = tokens(num_train, num_test)
    return ([{"input_ids": ids, "labels": ids.clone()} for ids in x],
            [{"input_ids": ids, "labels": ids.clone()} for ids in test_x])
