"""Early stopping: after each evaluation, stop when the watched metric has not improved by more than min_delta for
`patience` evaluations. The metrics are exact and identical on every rank, so every rank decides alike.

Its state (best value, count of evaluations without improvement, where it stopped) travels in checkpoints."""

from __future__ import annotations

from dataclasses import asdict, dataclass


def improvement(metric: str, value: float, reference: float | None) -> float:
    """How much better `value` is than `reference` (> 0: better); losses go down, accuracies up."""
    if reference is None:
        return float("inf")
    return reference - value if "loss" in metric else value - reference


@dataclass
class EarlyStopping:
    metric: str
    patience: int
    min_delta: float = 0.0
    best: float | None = None
    best_step: int | None = None
    num_bad: int = 0  # evaluations in a row without an improvement of more than min_delta
    stopped_at: int | None = None

    def update(self, step: int, metrics: dict) -> bool:
        """Takes one evaluation; True when training must stop here."""
        value = metrics[self.metric]
        if improvement(self.metric, value, self.best) > self.min_delta:
            self.best, self.best_step, self.num_bad = value, step, 0
        else:
            self.num_bad += 1
            if self.num_bad >= self.patience:
                self.stopped_at = step
        return self.stopped_at is not None

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def reason(self) -> str:
        return (f"early stop at step {self.stopped_at}: {self.metric} did not improve by more than "
                f"{self.min_delta:g} for {self.num_bad} evaluations (best {self.best:.6g} at step {self.best_step})")

    def state_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if key not in ("metric", "patience", "min_delta")}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.num_bad, self.stopped_at = state["num_bad"], state["stopped_at"]
