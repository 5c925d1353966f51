"""The contract of checkpoints as training sees it (Checkpointer), and the hooks a storage format gives the policy
that implements it (Storage): one file (distrib.checkpoint.format) or DCP shards (distrib.checkpoint.sharded)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol


class Checkpointer(Protocol):
    """What the trainer and the worker call, the same under every strategy. Every method is called by every rank."""

    run_id: str  # set by load(): the resumed checkpoint's run, or a new one
    resumed_from: Path | None  # set by load(): the checkpoint this run continues

    def load(self, resume: str, say: Callable[[str], None]) -> dict | None:
        """The state to resume from (checkpoint.resume: auto | never | a path), None for a new run."""

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due after `step`."""

    def name(self, step: int, *, best: bool = False) -> str:
        """The name save(step) gives its checkpoint, without the format's suffix: step_N (best_N), or step_N-RUNID
        when the run writes beside another run's checkpoints."""

    def save(self, step: int, *, best: bool = False) -> Path:
        """Writes the state at `step`: a periodic step_N (pruned to keep_last) or, best, a best_N (keep_best)."""

    def start(self) -> None:
        """As training begins: what the format writes through in the background starts now (a process)."""

    def wait(self) -> None:
        """Returns once the write in flight (if any) is committed."""

    def close(self) -> None:
        """Waits for the write in flight; at the end of a run or on a preemption."""


class Storage(Protocol):
    """A checkpoint format: where a checkpoint called `name` goes and how it is written atomically. Which one a
    run resumes, and which ones it deletes, is the policy's (distrib.checkpoint.policy), the same for every format."""

    kind: str  # how messages name the format: "one-file (ddp)" | "sharded (fsdp)"

    def target(self, directory: Path, name: str) -> Path:
        """The checkpoint `name` (step_00000004, best_00000008) in this format."""

    def write(self, path: Path, state: dict, committed: Callable[[], None] | None) -> None:
        """Every rank: writes `state` to `path`, never half; rank 0 runs `committed` once it is in place."""

    def start(self) -> None:
        """Every rank, as training begins: a background writer's process starts, overlapping the first steps."""

    def wait(self) -> None:
        """Returns once the write in flight (if any) is committed."""

    def close(self) -> None:
        """Waits for the write in flight and lets go of what the format holds."""
