"""TensorBoard scalars in run_dir/tensorboard (`metrics.loggers` names "tensorboard", or metrics.tensorboard = true).

A resumed run writes into the same folder and purges the abandoned attempt's events past the resumed step."""

from __future__ import annotations

import json
from pathlib import Path

from distrib.errors import UserError


def require():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("metrics.tensorboard = true: the tensorboard package is not installed; "
                        "pip install 'distrib[tensorboard]', or --set metrics.tensorboard=false") from None
    return SummaryWriter


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, settings, run_dir: Path):
        self.log_dir = Path(run_dir) / "tensorboard"
        self._board = None

    def open(self, params: dict, run_id: str | None, resumed_step: int | None) -> None:
        # purge_step: TensorBoard hides this folder's events at or after it, i.e. the earlier attempt's lost steps.
        purge = None if resumed_step is None else resumed_step + 1
        self._board = require()(log_dir=str(self.log_dir), purge_step=purge)
        self._board.add_text("config", _code(params), resumed_step or 0)

    def log(self, step: int, values: dict) -> None:
        for key, value in values.items():
            if key not in ("step", "epoch"):
                self._board.add_scalar(_board_tag(key), value, step)

    def summary(self, summary: dict) -> None:
        self._board.add_text("summary", _code(summary), summary.get("steps", 0))

    def close(self, status: str = "finished") -> None:
        if self._board:
            self._board.close()
            self._board = None


def _code(data: dict) -> str:
    """Markdown TensorBoard shows as a block: 4-space indented JSON."""
    return "\n".join("    " + line for line in json.dumps(data, indent=2, default=str).splitlines())


def _board_tag(key: str) -> str:
    """TensorBoard groups scalars by the part before '/': test/accuracy, train/loss, throughput/mfu."""
    if key.startswith(("test_", "val_")):
        split, _, name = key.partition("_")
        return f"{split}/{name}"
    return f"train/{key}" if key in ("loss", "lr") or key.endswith("loss") else f"throughput/{key}"  # aux_loss too
