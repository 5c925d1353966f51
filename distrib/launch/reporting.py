"""What distrib launch says about how its workers ended: one line per way of ending (ranks that ended alike share
it), the first failure last and with its exception, or a preemption as one; torch's own per-worker log lines left
out; and the marker that tells a worker the launcher prints its error, so it writes it to torch's error file instead
of stderr."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Callable, Collection, Iterator, Mapping

from distrib.errors import EXIT_HUNG, EXIT_PREEMPTED, UserError
from distrib.launch.lifeline import Status

# Set by distrib launch for its workers: it prints their errors (from torch's error file) in its last line, once for
# all ranks that share one, so a worker on its last attempt writes its error there instead of to stderr.
REPORTS_VAR = "DISTRIB_LAUNCH_REPORTS"


def errors_reported(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether distrib launch (not torchrun) started this worker, gave it an error file, and has no restart left for
    it, so its last line will say how the worker ended: the one reader of REPORTS_VAR (no torch import here)."""
    try:
        last_attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")) >= \
            int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False
    return environ.get(REPORTS_VAR) == "1" and "TORCHELASTIC_ERROR_FILE" in environ and last_attempt


def reported_by_launcher(error: UserError) -> bool:
    """A mistake in the input (exit 2), which every rank usually makes alike: a worker of distrib launch on its last
    attempt writes it to torch's error file instead of stderr, and the launcher's last line names it once for all the
    ranks that share it. Elsewhere (one process, torchrun, a restart still to come), and for a hung or lost peer
    (each rank's own story), the worker prints it."""
    if error.exit_code != UserError.exit_code or not errors_reported():
        return False
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)  # as @record does; also for errors raised outside its wrapper
    except Exception:  # noqa: BLE001 - no error file written: then the worker says it itself
        return False
    return True


def told_elsewhere(error: UserError) -> bool:
    """Whether another process says `error`'s line, so this one ends with its exit code and says nothing: distrib
    launch's last line (reported_by_launcher), or another survivor of the same lost peer (under torchrun too, where
    no launcher names the rank: one worker still does)."""
    return reported_by_launcher(error) or getattr(error, "told_elsewhere", False)


def _how(failure) -> str:
    """How a rank ended, and the first line of its exception when its entry point wrote torch's error file."""
    if failure.exitcode < 0:
        how = f"{{verb}} killed by signal {-failure.exitcode} ({failure.signal_name()})"
    else:
        how = f"exited with code {failure.exitcode}"
    message = failure.message
    if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {...}}
        text = str(message.get("message", "")).strip()
        how += f": {text.splitlines()[0]}" if text else ""
    return how


def _stopped(failure) -> bool:
    """Whether a rank ended as the launcher's SIGTERM ends it: with EXIT_PREEMPTED (a distrib worker checkpoints
    first) or killed by the signal."""
    return failure.exitcode in (EXIT_PREEMPTED, -signal.SIGTERM)


def cause_of(error) -> int | None:
    """The rank whose failure ended the run: the first one to end, unless it ended with EXIT_PREEMPTED, when it is the
    first rank that failed otherwise; None when no rank failed, only preempted (the others stopped with it)."""
    first, failure = error.get_first_failure()
    if failure.exitcode != EXIT_PREEMPTED:
        return first
    failed = [rank for rank, failure in error.failures.items() if not _stopped(failure)]
    return min(failed, key=lambda rank: (error.failures[rank].timestamp, rank)) if failed else None


def failure_lines(error, worker_pids: Mapping[int, int] | None = None,
                  killed_with_lifeline: Collection[int] = ()) -> list[str]:
    """A ChildFailedError as one line per way of ending, the cause last (where one looks first): which ranks, how they
    ended, and the first line of their exception, uncut, when the worker's entry point has @record. Ranks that
    failed alike (one mistake every rank makes) share one line. A run whose first rank to end was preempted (exit
    EXIT_PREEMPTED), and no rank failed otherwise, is a preemption: no line calls it a failure. killed_with_lifeline:
    the lifeline pids that recorded no exit code (torch's agent SIGKILLed them once its grace after the SIGTERM
    ended, its worker with it): stopped by the launcher, as are ranks that ended with its SIGTERM."""
    cause = cause_of(error)
    preemption = error.get_first_failure()[1].exitcode == EXIT_PREEMPTED  # the first rank to end was preempted
    by_how: dict[str, list[int]] = {}
    for rank in sorted(error.failures):
        failure = error.failures[rank]
        how = _how(failure)
        if preemption and failure.exitcode == EXIT_PREEMPTED:
            how = f"{{verb}} preempted (exit {EXIT_PREEMPTED}: checkpointed, or stopped before training)"
        elif rank != cause and (_stopped(failure) or failure.exitcode == -signal.SIGKILL
                                and failure.pid in killed_with_lifeline):  # not a failure of its own
            how = f"{{verb}} stopped by the launcher when the {'preemption' if preemption else 'first failure'} " \
                  "ended the run"
        by_how.setdefault(how, []).append(rank)
    lines = []
    for how, ranks in sorted(by_how.items(), key=lambda item: cause in item[1]):
        failures = [error.failures[rank] for rank in ranks]
        pids = [(worker_pids or {}).get(f.pid, f.pid) for f in failures]  # the worker's own pid, not its lifeline's
        if len(ranks) == 1:
            who = f"rank {ranks[0]} (local rank {failures[0].local_rank}, pid {pids[0]})"
        else:
            who = f"ranks {', '.join(map(str, ranks))} (pids {', '.join(map(str, pids))})"
        if how.startswith("{verb}"):
            how = ("was" if len(ranks) == 1 else "were") + how.removeprefix("{verb}")
        lines.append(f"distrib launch: {who} {how}" + (" [first failure]" if cause in ranks else ""))
    if cause is None:
        lines.append(f"distrib launch: the run was preempted; exit {EXIT_PREEMPTED}: requeue the job and it resumes "
                     "from its last checkpoint")
    return lines


def hang_line(note: Path, since_ns: int, world_size: int | None) -> str | None:
    """After the workers ended: where the ranks diverged, from the hang dumps named in `note` (HANG_NOTE_VAR) that
    were written since `since_ns`, or None when no rank dumped."""
    try:
        folder = Path(note.read_text())
    except OSError:
        return None
    from distrib.launch.hang_traces import divergence, read_traces

    traces = read_traces(folder, since_ns)
    if not traces:
        return None
    return f"distrib launch: hang: {divergence(traces, world_size)}; every rank's trace: {folder}"


def restart_line(attempt: int, statuses: list[Status], max_restarts: int) -> str | None:
    """After attempt `attempt` (0 for the first) failed with a restart left: one line naming the rank whose end
    failed it (the first to end otherwise than 0, 75 or the launcher's SIGTERM; else the first to end) and how, and
    "restarting (n of N)"; None on the last attempt (failure_lines says how it ended) or when no worker ended. The
    other ranks were stopped by the launcher, or failed because that rank was gone: they are not named."""
    ended = sorted((s for s in statuses if s.code not in (None, 0) and s.ended_ns is not None),
                   key=lambda s: s.ended_ns)
    if attempt >= max_restarts or not ended:
        return None
    cause = next((s for s in ended if s.code not in (EXIT_PREEMPTED, -signal.SIGTERM)), ended[0])
    if cause.code < 0:
        how = f"was killed by signal {-cause.code} ({signal.Signals(-cause.code).name})"
    elif cause.code == EXIT_HUNG:
        how = f"exited with code {cause.code}: it lost a peer, or waited for a hung one (a worker's line above " \
              "names which)"
    else:
        how = f"exited with code {cause.code}"
    who = f"rank {cause.rank} (local rank {cause.local_rank}, pid {cause.worker_pid})" if cause.rank is not None \
        else f"a worker (pid {cause.worker_pid})"
    return f"distrib launch: {who} {how}; restarting ({attempt + 1} of {max_restarts})"


@contextlib.contextmanager
def quiet_torch_failure_lines(on_failure: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Leaves out torch's agent's own log lines about failed and stopped workers ("failed (exitcode: 2) local_rank:
    ...", "Sending process ... closing signal SIGTERM"): failure_lines (or, before a restart, restart_line) says the
    same once, with the cause; on_failure() runs where the first of them is logged, once the agent has stopped
    every worker of the attempt and before it restarts them. Also torch's "Unable to shutdown process ... via 15,
    forcefully exiting via 9": a worker that outlived the agent's grace after its SIGTERM is one that waited in a
    collective for the rank that failed (it could neither finish its step nor checkpoint); it ended because of that
    rank, which the launcher's line names, and is not a failure of its own."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("failed (exitcode"):
            on_failure()
        return not message.startswith(("failed (exitcode", "Sending process", "Unable to shutdown process"))

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
