"""User-facing errors: mistakes the user can fix, reported as one line without a traceback.

The CLI is the only place that turns these into messages and exit codes."""

import os
import sys


class UserError(Exception):
    """A mistake in the user's input or environment; the message says what, the value, and the fix."""

    exit_code = 2  # what the CLI exits with (EXIT_USER_ERROR); subclasses for other kinds of fault override it


class ConfigError(UserError):
    """A config key or value that is not allowed."""


class CollectiveTimeoutError(UserError):
    """A collective outwaited dist.timeout_s: a rank stopped, or ran collectives the others did not; the message
    names the ranks that did not arrive, their host and last step."""

    exit_code = 69  # EXIT_HUNG


class PeerLostError(CollectiveTimeoutError):
    """A collective failed because another rank is gone (it died, and its own error says why): a secondary failure,
    told in one line instead of gloo's traceback."""


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

# Exit code of a run that failed because a rank stopped answering (hung, stopped, its host gone) or died under the
# others (EX_UNAVAILABLE): not the input's fault. The last line of the log names the rank, its host and last step.
EXIT_HUNG = CollectiveTimeoutError.exit_code


def say(text: str) -> None:
    """Writes text and its newline to stderr in one write, so that lines of several ranks sharing one terminal or log
    never interleave or glue together (print writes the text and the newline apart)."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test's capture, or closed
        sys.stderr.write(text + "\n")
        return
    data = (text + "\n").encode(errors="replace")
    while data:  # one write up to PIPE_BUF (4 KiB) is atomic; a longer line may need more than one
        data = data[os.write(fd, data):]
