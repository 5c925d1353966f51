"""The built-in GPT: a decoder-only transformer in the modern form (pre-norm RMSNorm, rotary positions, causal
scaled_dot_product_attention, SwiGLU MLP, optional weight tying), and its FLOPs per token for MFU.

Names follow torchtitan's Llama (tok_embeddings, layers.N.attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, norm, output)
so that a tensor-parallel plan can name the projections; each Block is one FSDP unit and one checkpointed block."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrib.distributed.context_parallel import MaskedAttention, block_causal_mask, documents_of
from distrib.distributed.step_inputs import step_inputs
from distrib.errors import ConfigError
from distrib.models.moe import STEP_BUFFERS, FeedForward, MoE, add_aux_losses


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq_len, head_dim] of the rotary angles pos / base^(2i / head_dim), each angle twice (the two
    halves of a head rotate together)."""
    inverse = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inverse)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each (x_i, x_{i + head_dim / 2}) pair of x [B, H, T, head_dim] by its position's angle."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions on q and k; with an attention callable instead (packed
    documents' MaskedAttention, or a context-parallel cut's over every rank's keys), what it returns for (q, k, v)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Callable | None = None) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: under tensor parallel each rank computes its own n_heads / dist.tensor_parallel of them
        q, k, v = (w(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True) if mask is None else mask(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    """One pre-norm transformer layer: x + attention(norm(x)), then x + feed_forward(norm(x)), or x + moe(norm(x))
    on a mixture-of-experts layer (`moe` in place of `feed_forward`: a tensor-parallel plan keeps its dense names)."""

    def __init__(self, dim: int, n_heads: int, hidden_dim: int, norm_eps: float, moe: MoE | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.moe = moe  # None on a dense layer: a plain attribute, no module
        if moe is None:
            self.feed_forward = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Callable | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        if self.moe is None:
            return x + self.feed_forward(self.ffn_norm(x))
        # a cut's attention (context parallel) names the group holding the sequences' other cuts: the MoE's aux loss
        # counts their choices too
        return x + self.moe(self.ffn_norm(x), getattr(mask, "group", None))


def swiglu_hidden(dim: int, multiple_of: int = 64) -> int:
    """8/3 x dim (the SwiGLU width with the parameters of a 4 x dim GELU MLP), rounded up to multiple_of."""
    return multiple_of * math.ceil(8 * dim / 3 / multiple_of)


def moe_layer_ids(moe_layers, n_layers: int) -> tuple[int, ...]:
    """The blocks that are mixtures of experts: "all", every Nth (an int N: blocks N-1, 2N-1, ..., Llama 4's
    interleave step), or a list of block indices (DeepSeek's first dense blocks: the others listed)."""
    if moe_layers == "all":
        return tuple(range(n_layers))
    if isinstance(moe_layers, int) and not isinstance(moe_layers, bool) and 1 <= moe_layers <= n_layers:
        return tuple(i for i in range(n_layers) if (i + 1) % moe_layers == 0)
    if isinstance(moe_layers, (list, tuple)) and moe_layers and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in moe_layers):
        return tuple(sorted(set(moe_layers)))
    raise ConfigError(f"model.kwargs.moe_layers = {moe_layers!r}: neither \"all\", a step from 1 to n_layers "
                      f"({n_layers}; N: every Nth block) nor a list of block indices in 0..{n_layers - 1}; e.g. "
                      "moe_layers = \"all\" or moe_layers = 2")


def _check_moe(n_experts: int, top_k: int, **at_least_zero: float) -> None:
    """A one-line ConfigError for a mixture-of-experts kwarg out of its range."""
    if not isinstance(n_experts, int) or n_experts < 0:
        raise ConfigError(f"model.kwargs.n_experts = {n_experts!r}: must be a whole number >= 0 (0: the dense GPT); "
                          "e.g. n_experts = 8")
    if n_experts and not (isinstance(top_k, int) and 1 <= top_k <= n_experts):
        raise ConfigError(f"model.kwargs.top_k = {top_k!r}: each token goes to top_k of the n_experts = {n_experts} "
                          f"experts; use a whole number from 1 to {n_experts}, e.g. top_k = {min(2, n_experts)}")
    for key, value in at_least_zero.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"model.kwargs.{key} = {value!r}: must be a number >= 0 (0: off, or the default); "
                              f"e.g. {key} = 0")


class GPT(nn.Module):
    """Token ids [B, T] (T <= seq_len) -> next-token logits [B, T, vocab_size].

    vocab_size and seq_len come from the data; n_layers, n_heads, dim, hidden_dim (0 = swiglu_hidden(dim)),
    tie_weights (output projection = token embedding), rope_base and norm_eps from model.kwargs.

    n_experts > 0 makes the moe_layers blocks mixtures of experts (distrib.models.moe): top_k routed experts of
    expert_hidden_dim (0: the dense hidden_dim) and n_shared_experts, a balance loss of aux_loss_coef (then forward
    returns {"logits", "aux_loss"}), DeepSeek-V3's bias balancing at bias_update_rate (distrib.training.experts) and
    capacity_factor (0: dropless). n_experts = 0 is the dense GPT, bitwise."""

    # The Hugging Face convention that dist.shard_modules = auto reads: these classes are the FSDP units (and the
    # blocks that speed.activation_checkpointing = blocks recomputes); the embedding and output stay in the root,
    # which keeps tied weights in one unit.
    _no_split_modules = ("Block",)
    # dist.tensor_parallel's plan (distrib.distributed.tensor_parallel): heads and the MLP's hidden units split over
    # the group, one all-reduce after each output projection; norms, embedding and output whole on every rank.
    # dist.pipeline_parallel's units, in the order forward runs them (distrib.distributed.pipeline): the blocks (`*`)
    # split balanced over the stages, the embeddings with the first, the final norm and output with the last. A stage
    # holds None for the units it does not run, and forward skips them.
    _pipeline_units = ("tok_embeddings", "layers.*", "norm", "output")
    _tp_plan = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
                "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
                "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
                "layers.*.feed_forward.w2": "rowwise"}

    def __init__(self, vocab_size: int = 256, seq_len: int = 256, n_layers: int = 4, n_heads: int = 4, dim: int = 128,
                 hidden_dim: int = 0, tie_weights: bool = True, rope_base: float = 10000.0, norm_eps: float = 1e-5,
                 n_experts: int = 0, top_k: int = 2, n_shared_experts: int = 0, expert_hidden_dim: int = 0,
                 moe_layers: str | int | list[int] = "all", aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 capacity_factor: float = 0.0):
        super().__init__()
        if dim % n_heads or (dim // n_heads) % 2:
            raise ValueError(f"model.kwargs dim = {dim} must be n_heads ({n_heads}) x an even head size; "
                             f"e.g. dim = {n_heads * 2 * max(1, dim // n_heads // 2)}")
        _check_moe(n_experts, top_k, n_shared_experts=n_shared_experts, expert_hidden_dim=expert_hidden_dim,
                   aux_loss_coef=aux_loss_coef, bias_update_rate=bias_update_rate, capacity_factor=capacity_factor)
        self.vocab_size, self.seq_len, self.dim = vocab_size, seq_len, dim
        self.n_layers, self.n_heads = n_layers, n_heads
        hidden_dim = hidden_dim or swiglu_hidden(dim)
        self.moe_layer_ids = moe_layer_ids(moe_layers, n_layers) if n_experts else ()
        self.aux_loss_coef = aux_loss_coef if n_experts else 0.0

        def moe(index: int) -> MoE | None:
            if index not in self.moe_layer_ids:
                return None
            return MoE(dim, expert_hidden_dim or hidden_dim, n_experts, top_k, n_shared_experts, capacity_factor,
                       aux_loss_coef, bias_update_rate)

        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden_dim, norm_eps, moe(index)) for index in range(n_layers))
        self._plans_for_experts()
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.tie_weights, self.rope_base = tie_weights, rope_base
        # recomputed on build (reset_parameters): not in model.pt
        self.register_buffer("rope_cos", torch.empty(seq_len, dim // n_heads), persistent=False)
        self.register_buffer("rope_sin", torch.empty(seq_len, dim // n_heads), persistent=False)
        self.reset_parameters()

    def _plans_for_experts(self) -> None:
        """What the wrappers read of a mixture of experts: DDP broadcasts rank 0's buffers before a synced forward,
        and each rank's step counts must stay its own; with every block MoE, a tensor-parallel plan has no
        feed_forward to split (the experts stay whole on each rank)."""
        if self.moe_layer_ids:
            self._ddp_params_and_buffers_to_ignore = [f"layers.{index}.moe.{name}" for index in self.moe_layer_ids
                                                      for name in STEP_BUFFERS]
        if len(self.moe_layer_ids) == self.n_layers:
            self._tp_plan = {name: style for name, style in GPT._tp_plan.items() if ".feed_forward." not in name}

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: normal(0, 0.02), the residual projections scaled by 1 / sqrt(2 x n_layers); and
        the rotary tables. It writes every parameter and buffer, so a sharded run initialises each rank's shards
        from the seed (distrib.distributed.strategies.materialise), never holding the model whole."""
        cos, sin = rotary_tables(self.seq_len, self.dim // self.n_heads, self.rope_base)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for name, param in self.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param)  # the RMSNorm gains
            else:
                residual = name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "experts.w2",
                                          "shared_experts.w2.weight"))
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * self.n_layers) if residual else 0.02)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_parameters()  # its bias and step counts
        if self.tie_weights:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, attend: Callable | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """position_ids [B, T] (packed documents, restarting at 0 at each document's first token): rotary positions
        and a block-causal mask from them; document_ids (default: documents_of(position_ids)) may come from a whole
        window this is a slice of. None: positions 0..T-1 and the causal triangle. attend: input_ids are a cut of the
        window (context parallel: distrib.distributed.context_parallel), position_ids their places in it, and
        attend(q, k, v) each block's attention of them over the whole window's keys. A pipeline stage is handed its
        input alone: inside a pipeline's step (step_inputs) the positions (and attend, under cp) are the step's."""
        length = input_ids.shape[1]
        if attend is None and position_ids is None and document_ids is None and (step := step_inputs()) is not None:
            position_ids, attend = step.position_ids, step.attend
        if length > self.seq_len:
            raise ValueError(f"a sequence of {length} tokens is longer than the model's seq_len {self.seq_len}")
        if attend is None:
            cos, sin, mask = self._positions(length, position_ids, document_ids)
        else:
            cos, sin, mask = self.rope_cos[position_ids][:, None], self.rope_sin[position_ids][:, None], attend
        # Under pipeline parallel a stage may lack the embeddings (its input is the previous stage's activations),
        # the final norm or the output (it returns its own).
        x = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids
        for layer in self.layers:
            x = layer(x, cos, sin) if mask is None else layer(x, cos, sin, mask)
        x = self.norm(x) if self.norm is not None else x
        x = self.output(x) if self.output is not None else x
        if not self.aux_loss_coef:
            return x
        moes = [layer.moe for layer in self.layers if layer.moe is not None]
        if self.tok_embeddings is None or self.output is None:  # a pipeline stage: its output is one tensor
            return add_aux_losses(x, moes)
        return {"logits": x, "aux_loss": torch.stack([moe.aux_loss for moe in moes]).sum()}

    def _positions(self, length: int, position_ids: torch.Tensor | None, document_ids: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, MaskedAttention | None]:
        """The rotary tables for the positions ([T, head_dim], or [B, 1, T, head_dim] per token) and the attention
        under the documents' mask, which the layers share (MaskedAttention: one additive mask, not one a layer)."""
        if position_ids is None:
            return self.rope_cos[:length], self.rope_sin[:length], None
        documents = documents_of(position_ids) if document_ids is None else document_ids
        return (self.rope_cos[position_ids][:, None], self.rope_sin[position_ids][:, None],
                MaskedAttention(block_causal_mask(documents, documents)))

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token as torchtitan and PaLM count them: 6 x the parameters of the matrix products
        (the embedding lookup is none, unless tied, when its table is the output projection's) plus the attention
        scores and their weighted sum, 12 x layers x heads x head_dim x seq_len. Of the routed experts, the top_k
        that each token runs (the active parameters)."""
        # a tied table is counted once, as the output; the experts' shapes, as expert parallel may hold a share
        params = sum(p.numel() for name, p in self.named_parameters() if ".experts." not in name)
        for moe in (module for module in self.modules() if isinstance(module, MoE)):
            params += moe.top_k * 3 * moe.experts.dim * moe.experts.hidden_dim
        if not self.tie_weights:
            params -= self.tok_embeddings.weight.numel()
        head_dim = self.dim // self.n_heads
        return 6 * params + 12 * self.n_layers * self.n_heads * head_dim * (seq_len or self.seq_len)
