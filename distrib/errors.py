"""User-facing errors: mistakes the user can fix, reported as one line without a traceback.

The CLI is the only place that turns these into messages and exit codes (and distrib.fit's excepthook, for the
one that ends a script)."""

import os
import sys
from typing import NoReturn


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
    told in one line instead of gloo's traceback. told_elsewhere: another survivor of the same loss says that line
    (the first to claim it, PeerWatch.first_to_tell), so this rank ends with the same exit code and says nothing: the
    log names the lost rank once, not once per survivor."""

    def __init__(self, message: str, told_elsewhere: bool = False):
        super().__init__(message)
        self.told_elsewhere = told_elsewhere


class DeviceMismatchError(UserError):
    """Tensors that are not on the worker's device; the message lists each one."""


class EnvironmentFault(UserError):
    """The machine, not the input: a full disk (ENOSPC, a quota), a read-only or failing filesystem."""

    exit_code = 74  # EXIT_ENVIRONMENT


# Exit code of a run that stopped for preemption and should be requeued (EX_TEMPFAIL, "try again later"):
# a worker that checkpointed on a preemption signal exits with it, distrib launch passes it on, and
# scripts/slurm/train.sbatch answers it with `scontrol requeue`.
EXIT_PREEMPTED = 75


class Preempted(SystemExit):
    """A stop signal (checkpoint.signals) ended training: every rank agreed on it at one step boundary and the
    checkpoint is on disk. A SystemExit with code EXIT_PREEMPTED, as Lightning's SIGTERMException is one: uncaught,
    the process ends with 75 and no traceback (`except Exception` does not catch it); a script that must act on it
    catches distrib.Preempted, then re-raises it (or exits 75 itself) so the job is requeued. announce: whether this
    process says line() (rank 0 does; the other ranks stop with it quietly, so the log says it once)."""

    def __init__(self, step: int, path, announce: bool = True):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.path, self.announce = step, path, announce

    def __str__(self) -> str:
        return f"preempted at step {self.step}; checkpoint {self.path}"

    def line(self) -> str:
        """The one line a preempted process says before it ends."""
        return f"distrib: {self}; exit code {EXIT_PREEMPTED}: requeue the job (or run the same command) and it " \
               "resumes there"

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


def hard_exit(code: int) -> NoReturn:
    """Ends the process without interpreter teardown: gloo's threads can otherwise SIGABRT at exit (pytorch#190489);
    the process group was already closed (barrier, then destroy) by the runtime."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
