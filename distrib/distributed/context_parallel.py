"""Context parallel's mechanism (its declaration: distrib.distributed.dimensions.context): each of the C ranks of a
`cp` group holds 1/C of every sequence, and attention gathers the keys and values of the others.

The cut is balanced for causal attention (Llama 3's, torchtitan's): the window is cut into 2C chunks, and rank i holds
chunk i and its mirror 2C-1-i, so that every rank's queries see as many earlier keys as another's. Rotary positions are
the tokens' places in the window (the model's position_ids). Attention all-gathers keys and values across the group
(Llama 3's all-gather context parallel; its backward reduce-scatters their gradients) and masks by the global places,
so it runs on gloo and the CPU, with any mask. On CUDA it runs the same: torch's ring attention
(torch.distributed.tensor.experimental.context_parallel) is the faster path, waiting to be wired where SDPA's
kernels allow it (it runs on no CPU backend and takes no arbitrary mask).

Packed documents (data.document_mask) mask by document too: each rank takes the document ids of the whole window
before the cut (documents_of), so its queries and the gathered keys keep their documents. A Hugging Face decoder's
layers reach the gathered attention through transformers' attention interface (reach_attention registers
HF_ATTENTION); the step hands `attend` down through the forward's keyword arguments to it.

Under pipeline parallel the stages pass one tensor (the activations), so what is no tensor between stages (the cut's
positions and its attention) reaches every stage's blocks through the step's inputs (distrib.distributed.step_inputs,
entered by the pipeline's runner around the schedule's step; the built-in GPT and a transformers decoder's stage read
them where their forward is handed neither). Forward-only passes (evaluation: whole windows) run outside it."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distrib.distributed.step_inputs import ATTEND, INPUT_IDS, POSITION_IDS
from distrib.torch_private import all_gather_single_autograd

# ATTEND: the model's keyword for what attends on a cut of the window (the built-in GPT's forward: `attend`).
# The name a transformers decoder's attention runs under (config._attn_implementation) once reach_attention set it.
HF_ATTENTION = "distrib_context_parallel"


def chunk_places(length: int, degree: int, index: int, device=None) -> torch.Tensor:
    """The window places [length / degree] that rank `index` of a `degree`-rank group holds: chunk index of the 2 x
    degree chunks, then chunk 2 x degree - 1 - index."""
    size = length // (2 * degree)
    head, tail = index * size, (2 * degree - 1 - index) * size
    return torch.cat([torch.arange(head, head + size, device=device), torch.arange(tail, tail + size, device=device)])


def gathered_places(length: int, degree: int, device=None) -> torch.Tensor:
    """Every rank's places in the order an all-gather across the group lays their keys out (rank 0's first)."""
    return torch.cat([chunk_places(length, degree, index, device) for index in range(degree)])


def causal_mask(query_places: torch.Tensor, key_places: torch.Tensor) -> torch.Tensor:
    """[Tq, Tk] bool, True where a query may attend to a key: not a later place in the window."""
    return key_places[None, :] <= query_places[:, None]


def documents_of(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] ids, equal within a document, of packed positions (distrib.data.documents: 0 starts a document). Take
    them from the whole window: a slice of it (a context-parallel chunk) cannot tell where its first document began."""
    return (position_ids == 0).cumsum(dim=-1)


def block_causal_mask(query_documents: torch.Tensor, key_documents: torch.Tensor,
                      query_index: torch.Tensor | None = None, key_index: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, Tq, Tk] bool, True where a query may attend to a key: the same document and not a later token. The
    indexes are the tokens' places in the whole window (default 0..T-1), so a chunk of queries can be masked
    against all keys."""
    if query_index is None:
        query_index = torch.arange(query_documents.shape[-1], device=query_documents.device)
    if key_index is None:
        key_index = torch.arange(key_documents.shape[-1], device=key_documents.device)
    same = query_documents[:, :, None] == key_documents[:, None, :]
    return (same & causal_mask(query_index, key_index))[:, None]


def cut(tensor: torch.Tensor, places: torch.Tensor) -> torch.Tensor:
    """A [B, T, ...] tensor's positions at places (along T)."""
    return tensor.index_select(1, places)


def restore(chunks: list[torch.Tensor], degree: int) -> torch.Tensor:
    """The window [B, T, ...] from every rank's cut, in rank order (cut's inverse)."""
    length = sum(chunk.shape[1] for chunk in chunks)
    places = gathered_places(length, degree, chunks[0].device)
    whole = torch.empty_like(torch.cat(chunks, dim=1))
    whole[:, places] = torch.cat(chunks, dim=1)
    return whole


class MaskedAttention:
    """Attention of queries [B, H, Tq, D] over keys and values under one boolean mask [..., Tq, Tk] (True: attends)
    for every layer of a micro-batch. SDPA turns a boolean mask into an additive one of the queries' dtype at each
    call and keeps that for backward, a float mask a layer; an additive mask of the queries' dtype it keeps as it is,
    no copy. So the first layer's call makes it (additive) and the others are handed the same tensor: one mask a
    micro-batch (this object lives one: cut_batch makes one a micro-batch)."""

    def __init__(self, mask: torch.Tensor):
        self.mask, self._additive = mask, None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                 ) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:  # grouped-query attention: the fewer heads, repeated for the queries
            k, v = (rows.repeat_interleave(q.shape[1] // rows.shape[1], dim=1) for rows in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.additive(q.dtype), scale=scale)

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as SDPA's additive one (0 where True, -inf where not: SDPA's own conversion, so the same
        results), in `dtype` (SDPA takes no other than the queries'), made once."""
        if self._additive is None or self._additive.dtype != dtype:
            self._additive = torch.full(self.mask.shape, float("-inf"), dtype=dtype, device=self.mask.device)
            self._additive.masked_fill_(self.mask, 0.0)
        return self._additive


class GatheredAttention(MaskedAttention):
    """Attention of this rank's queries [B, H, Tq, D] over the keys and values of every rank of the group, gathered in
    rank order, under a mask of their places (causal_mask): what the model's attention runs in place of its own on a
    cut of the window."""

    def __init__(self, mask: torch.Tensor, group: dist.ProcessGroup):
        super().__init__(mask)
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                 ) -> torch.Tensor:
        return super().__call__(q, self.gather(k), self.gather(v), scale)

    def rows(self, samples: torch.Tensor) -> GatheredAttention:
        """The attention of a pipeline's microbatch: these samples' rows of a mask per sample (packed windows)."""
        return self if self.mask.dim() < 4 else GatheredAttention(self.mask.index_select(0, samples), self.group)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] of this rank -> [B, H, C x T, D] of the group, in rank order. The autograd all-gather's
        backward reduce-scatters the gradients (torch.distributed.nn.functional.all_gather, measured, gave the keys'
        and values' gradients 13-21 off on gloo); it gathers along the first dimension only."""
        gathered = all_gather_single_autograd(rows.permute(2, 0, 1, 3).contiguous(), gather_dim=0, group=self.group)
        return gathered.permute(1, 2, 0, 3)


def cut_batch(inputs: torch.Tensor | dict, targets: torch.Tensor, degree: int, index: int,
              group: dist.ProcessGroup) -> tuple[dict, torch.Tensor]:
    """A micro-batch of token windows [B, T] (or packed ones: {input_ids, position_ids}) as rank `index` of the group
    runs it: its two chunks of the inputs, with their positions (global places, or the packed positions) and the
    attention over the group's keys under the mask of their places (and documents), and of the targets."""
    tokens, packed = (inputs[INPUT_IDS], inputs[POSITION_IDS]) if isinstance(inputs, dict) else (inputs, None)
    batch, length = tokens.shape
    places = chunk_places(length, degree, index, tokens.device)
    every = gathered_places(length, degree, tokens.device)
    if packed is None:
        positions, mask = places.expand(batch, -1), causal_mask(places, every)
    else:  # each token's document from the whole window, before the cut
        documents = documents_of(packed)
        positions, mask = cut(packed, places), block_causal_mask(cut(documents, places), cut(documents, every),
                                                                 places, every)
    model_inputs = {INPUT_IDS: cut(tokens, places), POSITION_IDS: positions, ATTEND: GatheredAttention(mask, group)}
    return model_inputs, cut(targets, places)


def takes_attend(model: nn.Module) -> bool:
    """Whether the model's forward takes `attend` by name (the built-in GPT's)."""
    return ATTEND in inspect.signature(type(model).forward).parameters


def reachable(model: nn.Module) -> bool:
    """Whether context parallel reaches the model's attention: its forward takes `attend`, or it is a transformers
    model whose layers run the attention function its config names (transformers' attention interface)."""
    return takes_attend(model) or (getattr(type(model), "_supports_attention_backend", False)
                                   and hasattr(model, "set_attn_implementation"))


def reach_attention(model: nn.Module) -> nn.Module:
    """The model, its attention reaching the group: as it is when its forward takes `attend`; a transformers model's
    layers set to run hf_attention (registered under HF_ATTENTION, with SDPA's masks for whole windows)."""
    if takes_attend(model):
        return model
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(HF_ATTENTION, hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION, sdpa_mask)
    model.set_attn_implementation(HF_ATTENTION)
    return model


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 attend: GatheredAttention | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function under context parallel: this rank's queries over the group's keys and values
    (attend, handed down by the step's forward; its mask replaces the one transformers made of the cut's positions),
    [B, T, H, D] as transformers' own return; SDPA's where no step cut the window (evaluation, generation)."""
    if attend is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attend(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None
