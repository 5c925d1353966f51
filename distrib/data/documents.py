"""Packed documents (data.document_mask): where the documents of a token window start, and each token's position in
its own document, the `position_ids` a batch carries to the model.

A document starts at a window's first token, after an end-of-document id (data.eos_id: the id ends its document and
belongs to it) and at the first token of each file of the stream. The positions restart at 0 there, so they alone
say where each document starts: a model builds its block-causal mask from them (distrib.models.gpt.documents_of;
transformers' own packed-sequence path), and a sliced window (context parallel) keeps each token's document if the
ids are taken from the whole window first."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distrib.distributed.step_inputs import INPUT_IDS, POSITION_IDS  # the keys of a packed batch, as the stages read it


def document_starts(tokens: torch.Tensor, eos_id: int, file_starts: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: True where a document starts in each window of token ids [B, T]: the first token, a token after
    eos_id (-1: none), and where file_starts (bool [B, T]: the token is a file's first) says so."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    if eos_id >= 0:
        starts[:, 1:] |= tokens[:, :-1] == eos_id
    if file_starts is not None:
        starts |= file_starts
    return starts


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """[B, T] int64: each token's distance from the start of its document (document_starts' [B, T] bool)."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def packed_inputs(tokens: torch.Tensor, eos_id: int, file_starts: torch.Tensor | None = None) -> dict:
    """The inputs of a packed batch: {input_ids, position_ids} of token ids [B, T]."""
    return {INPUT_IDS: tokens, POSITION_IDS: document_positions(document_starts(tokens, eos_id, file_starts))}


def words(eos_id: int) -> str:
    """The start-up log's words for the packing."""
    after = f"after id {eos_id}, " if eos_id >= 0 else ""
    return f"packed documents (each attends only to itself; one starts {after}at each file's first token)"


def first_tokens(positions: np.ndarray, file_offsets: np.ndarray) -> np.ndarray:
    """bool, shaped as positions (stream positions): True at the first token of a file (file_offsets: where each
    file of the stream starts, the first at 0)."""
    return np.isin(positions, file_offsets[1:])


@dataclass(frozen=True, eq=False)
class Documents:
    """Where a stream's documents start: after eos_id (-1: none) and at file_offsets (the stream positions where its
    files start)."""

    eos_id: int
    file_offsets: np.ndarray

    def inputs(self, tokens: torch.Tensor, positions: np.ndarray) -> dict:
        """The packed inputs of the windows of token ids [B, T] read at stream positions [B, T]."""
        files = first_tokens(positions, self.file_offsets)
        return packed_inputs(tokens, self.eos_id, torch.from_numpy(files).to(tokens.device) if files.any() else None)
