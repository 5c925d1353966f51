"""Context parallel's mechanism (its declaration: distrib.distributed.dimensions.context): each of the C ranks of a
`cp` group holds 1/C of every sequence, and attention gathers the keys and values of the others.

The cut is balanced for causal attention (Llama 3's, torchtitan's): the window is cut into 2C chunks, and rank i holds
chunk i and its mirror 2C-1-i, so that every rank's queries see as many earlier keys as another's. Rotary positions are
the tokens' places in the window (the model's position_ids). Attention all-gathers keys and values across the group
(Llama 3's all-gather context parallel; its backward reduce-scatters their gradients) and masks by the global places,
so it runs on gloo and the CPU, with any mask. On CUDA it runs the same: torch's ring attention
(torch.distributed.tensor.experimental.context_parallel) is the faster path, waiting to be wired where SDPA's
kernels allow it (it runs on no CPU backend and takes no arbitrary mask)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distrib.torch_private import all_gather_single_autograd

# The model's keyword for what attends on a cut of the window (the built-in GPT's forward: `attend`).
ATTEND = "attend"


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


class GatheredAttention:
    """Attention of this rank's queries [B, H, Tq, D] over the keys and values of every rank of the group, gathered in
    rank order, under a mask of their places (causal_mask): what the model's attention runs in place of its own on a
    cut of the window."""

    def __init__(self, mask: torch.Tensor, group: dist.ProcessGroup):
        self.mask, self.group = mask, group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, self.gather(k), self.gather(v), attn_mask=self.mask)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] of this rank -> [B, H, C x T, D] of the group, in rank order. The autograd all-gather's
        backward reduce-scatters the gradients (torch.distributed.nn.functional.all_gather, measured, gave the keys'
        and values' gradients 13-21 off on gloo); it gathers along the first dimension only."""
        gathered = all_gather_single_autograd(rows.permute(2, 0, 1, 3).contiguous(), gather_dim=0, group=self.group)
        return gathered.permute(1, 2, 0, 3)


def cut_batch(inputs: torch.Tensor, targets: torch.Tensor, degree: int, index: int, group: dist.ProcessGroup
              ) -> tuple[dict, torch.Tensor]:
    """A micro-batch of token windows [B, T] as rank `index` of the group runs it: its two chunks of the inputs, with
    their global positions and the attention over the group's keys, and of the targets."""
    batch, length = inputs.shape
    places = chunk_places(length, degree, index, inputs.device)
    mask = causal_mask(places, gathered_places(length, degree, inputs.device))
    model_inputs = {"input_ids": cut(inputs, places), "position_ids": places.expand(batch, -1),
                    ATTEND: GatheredAttention(mask, group)}
    return model_inputs, cut(targets, places)
