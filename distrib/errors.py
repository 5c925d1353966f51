"""User-facing errors: mistakes the user can fix, reported as one line without a traceback.

The CLI is the only place that turns these into messages and exit codes."""


class UserError(Exception):
    """A mistake in the user's input or environment; the message says what, the value, and the fix."""


class ConfigError(UserError):
    """A config key or value that is not allowed."""


class CollectiveTimeoutError(UserError):
    """A collective outwaited dist.timeout_s: a rank stopped, or ran collectives the others did not."""


class DeviceMismatchError(UserError):
    """Tensors that are not on the worker's device; the message lists each one."""


# Exit code of a run that stopped for preemption and should be requeued (EX_TEMPFAIL, "try again later"):
# a worker that checkpointed on a preemption signal exits with it, distrib launch passes it on, and
# scripts/slurm/train.sbatch answers it with `scontrol requeue`.
EXIT_PREEMPTED = 75
