"""What a pipeline's micro-step hands every stage beside the one tensor its stages pass (the token ids, then the
activations): the windows' positions (packed documents' restarting ones, or context parallel's places) and the
attention over the cp group's keys, each microbatch's rows of them (the schedule's stage says which microbatch runs).

Context variables, so a forward-only pass outside the step, or another thread, never sees them; the built-in GPT's
forward and a transformers decoder's stage (distrib.distributed.pipeline.decoder) read them where they are handed
their input alone."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

# a packed batch's keys (the Hugging Face names; distrib.data.documents makes them) and the cut's attention
INPUT_IDS, POSITION_IDS, ATTEND = "input_ids", "position_ids", "attend"


@dataclass(frozen=True)
class StageInputs:
    """One microbatch's position_ids [b, T'] and attend (None without context parallel: the stage masks by the
    positions' documents itself)."""

    position_ids: torch.Tensor
    attend: Callable | None


@dataclass(frozen=True)
class _Step:
    position_ids: torch.Tensor  # [B, T'] of the micro-batch
    attend: Callable | None  # with rows(samples): a microbatch's (context_parallel.GatheredAttention)
    microbatches: int

    def of(self, index: int) -> StageInputs:
        """Microbatch `index`'s rows, as the schedule cuts the micro-batch (torch.tensor_split along the samples)."""
        if self.microbatches == 1:
            return StageInputs(self.position_ids, self.attend)
        rows = torch.tensor_split(torch.arange(self.position_ids.shape[0], device=self.position_ids.device),
                                  self.microbatches)[index]
        attend = None if self.attend is None else self.attend.rows(rows)  # packed windows under cp: a mask a sample
        return StageInputs(self.position_ids.index_select(0, rows), attend)


_STEP: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("pipeline_step", default=None)
_MICROBATCH: contextvars.ContextVar[int] = contextvars.ContextVar("pipeline_microbatch", default=0)


def handed_alone(inputs) -> bool:
    """Whether a micro-batch's inputs are more than one tensor that stages can take from the step: token ids with
    their positions (packed documents), and context parallel's attention."""
    return isinstance(inputs, dict) and INPUT_IDS in inputs and POSITION_IDS in inputs \
        and set(inputs) <= {INPUT_IDS, POSITION_IDS, ATTEND}


@contextlib.contextmanager
def stepping(model_inputs: dict, microbatches: int = 1) -> Iterator[torch.Tensor]:
    """Inside: the micro-batch's positions and attention (a dict that handed_alone accepts) reach every stage's
    forward (step_inputs), each microbatch's rows; yields the token ids, the one tensor a pipeline cuts into
    microbatches."""
    token = _STEP.set(_Step(model_inputs[POSITION_IDS], model_inputs.get(ATTEND), microbatches))
    try:
        yield model_inputs[INPUT_IDS]
    finally:
        _STEP.reset(token)


@contextlib.contextmanager
def microbatch(index: int) -> Iterator[None]:
    """Inside: the schedule's stage runs microbatch `index` (its forward: the rows step_inputs hands)."""
    token = _MICROBATCH.set(index)
    try:
        yield
    finally:
        _MICROBATCH.reset(token)


def step_inputs() -> StageInputs | None:
    """The running microbatch's positions and attend inside stepping; None outside (whole windows, no documents)."""
    step = _STEP.get()
    return None if step is None else step.of(_MICROBATCH.get())
