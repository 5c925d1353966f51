"""User-facing errors: mistakes the user can fix, reported as one line without a traceback.

The CLI is the only place that turns these into messages and exit codes."""


class UserError(Exception):
    """A mistake in the user's input or environment; the message says what, the value, and the fix."""

    exit_code = 2  # what the CLI exits with (EXIT_USER_ERROR); subclasses for other kinds of fault override it


class ConfigError(UserError):
    """A config key or value that is not allowed."""


class CollectiveTimeoutError(UserError):
    """A collective outwaited dist.timeout_s: a rank stopped, or ran collectives the others did not."""


class DeviceMismatchError(UserError):
    """Tensors that are not on the worker's device; the message lists each one."""


class EnvironmentFault(UserError):
    """The machine, not the input: a full disk (ENOSPC, a quota), a read-only or failing filesystem."""

    exit_code = 74  # EXIT_ENVIRONMENT


# Exit code of a run that stopped for preemption and should be requeued (EX_TEMPFAIL, "try again later"):
# a worker that checkpointed on a preemption signal exits with it, distrib launch passes it on, and
# scripts/slurm/train.sbatch answers it with `scontrol requeue`.
EXIT_PREEMPTED = 75

# Exit code of a run that failed for its environment, not its input (EX_IOERR): a checkpoint or output that could not
# be written (disk full, quota, read-only or failing filesystem); the earlier files are kept. Fix the machine (free
# space, another folder) and run the same command again: it resumes from the last checkpoint.
EXIT_ENVIRONMENT = EnvironmentFault.exit_code
