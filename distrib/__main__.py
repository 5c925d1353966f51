"""The `distrib` command (the console script and `python -m distrib`): its first statements take the stop signals,
before anything else is imported, then it runs the CLI (distrib.cli.entry)."""

import os
import signal

# Copies, not imports (tests/unit/test_lifecycle.py checks them): nothing may come before the handlers.
_EXIT_PREEMPTED = 75  # distrib.errors.EXIT_PREEMPTED
_REPORTS_VAR = "DISTRIB_LAUNCH_REPORTS"  # distrib.launch.reporting.REPORTS_VAR
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # distrib.launch.exits.STOP_SIGNALS


def _stopped(signum, frame) -> None:
    """Until a later handler takes the signal over (the launcher's, the worker's exit_on_signals, the training
    steps' flag), a stop ends the process with EXIT_PREEMPTED: nothing was written yet (or all of it was). A SLURM
    preemption in a job's first seconds ended it with 143 while the CLI imported torch, and SLURM did not requeue
    it. Not by raising: inside an import an exception can be swallowed or leave a module half-initialised."""
    try:
        if os.environ.get(_REPORTS_VAR) != "1":  # a worker of distrib launch: the launcher says how it ended
            os.write(2, f"distrib: stopped by {signal.Signals(signum).name} outside the training steps (starting up, "
                        f"or after the end), so nothing was lost; exit code {_EXIT_PREEMPTED}: requeue the job (or run "
                        "the same command again) and it starts (or resumes) there\n".encode())
    finally:
        os._exit(_EXIT_PREEMPTED)


def entry() -> None:
    """The console script (pyproject.toml) and `python -m distrib`."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stopped)
    from distrib.cli import entry as run_cli

    run_cli()


if __name__ == "__main__":
    entry()
