"""Weights & Biases (`metrics.loggers` names "wandb"; pip install 'distrib[wandb]'): the resolved config as the run's
config, every log step and evaluation against our step, the summary; a resumed run continues the same W&B run.

Offline (WANDB_MODE=offline) it writes under run_dir/wandb; `wandb sync` uploads it later."""

from __future__ import annotations

from pathlib import Path

from distrib.errors import UserError

EXTRA = "pip install 'distrib[wandb]'"


def require():
    try:
        import wandb
    except ImportError:
        raise UserError(f"metrics.loggers includes wandb: the wandb package is not installed; {EXTRA}, "
                        "or remove wandb from metrics.loggers") from None
    return wandb


class WandbLogger:
    name = "wandb"

    def __init__(self, settings, run_dir: Path):
        self.settings, self.run_dir = settings, Path(run_dir)
        self._run = None

    def open(self, params: dict, run_id: str | None, resumed_step: int | None) -> str:
        wandb = require()
        try:
            self._run = wandb.init(
                project=self.settings.project, name=self.settings.run_name or self.run_dir.name,
                tags=list(self.settings.tags), config=params, dir=str(self.run_dir), id=run_id,
                resume="allow" if run_id else None,
                # console off: W&B would otherwise wrap our stdout and stderr to copy them.
                settings=wandb.Settings(console="off"))
        except Exception as e:  # noqa: BLE001 - no login, unreachable server, bad project: one line, not a traceback
            raise UserError(f"metrics.loggers includes wandb: W&B did not start a run ({_first_line(e)}); run "
                            "`wandb login` or set WANDB_API_KEY, or WANDB_MODE=offline to log locally") from None
        if run_id:
            self._run.config.update(params, allow_val_change=True)  # an extended run may change max_steps
        # Our step is the x axis, not W&B's own counter: after a restart it goes back to the resumed step, and
        # W&B would drop every point below its counter.
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        return self._run.id

    def log(self, step: int, values: dict) -> None:
        self._run.log({"step": step, **values})

    def summary(self, summary: dict) -> None:
        self._run.summary.update(summary)

    def close(self, status: str = "finished") -> None:
        if self._run:
            self._run.finish(exit_code=0 if status == "finished" else 1)
            self._run = None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"
