"""The checkpoint process of `checkpoint.async_save = process`: torch's DCP writer process, started as training
begins and tied to its rank by Linux's parent-death signal, its death said at once and agreed on by every rank; and
the check that the script can start one at all (a process started with spawn runs the top level of the script that
started it again)."""

from __future__ import annotations

import ast
import contextlib
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from distrib.checkpoint.format import CheckpointError
from distrib.errors import say
from distrib.launch.lifeline import STOP_SIGNALS, tied_to_parent
from distrib.torch_private import (
    AsyncCheckpointProcess,
    CheckpointSaveProcessControlOpts,
    ProcessGroupInitInfo,
    checkpoint_process,
    set_checkpoint_process,
)

GUARD = 'if __name__ == "__main__":'
START_TIMEOUT_S = 1800  # torch's own wait for its process's gloo group (every rank's process must join it)
STOP_S = 1.0
DEATH_S = 5.0  # after a failed write, how long to wait for the checkpoint process's end to show (agree_on_writers)


class CheckpointProcess(AsyncCheckpointProcess):
    """torch's process-based DCP writer (the one dcp.async_save with AsyncCheckpointerType.PROCESS starts on its
    first save), started here instead: as training begins (ShardedStorage.start), so that its start (importing
    torch, opening its own gloo group of every rank's process) overlaps the first steps rather than the first save;
    from the calling thread, the training one, because the parent-death signal follows the thread that started the
    process, and torch starts it from a pool thread that ends after that first save. Every rank creates one, in
    the same order (a broadcast in `group`)."""

    def __init__(self, group: dist.ProcessGroup):  # not torch's __init__, which waits for the process to start
        info = ProcessGroupInitInfo(group)
        self.ctx = torch.multiprocessing.get_context("spawn")
        self._process_pipe, child_end = self.ctx.Pipe()
        self._save_process = self.ctx.Process(
            target=tied_to_parent, name="distrib-checkpoint", daemon=True,
            args=(os.getpid(), AsyncCheckpointProcess._checkpointing_subprocess, info, child_end))
        # Started with the stop signals blocked (it ignores them once it runs: tied_to_parent), so that none sent to
        # the process group while it imports torch ends it. multiprocessing's resource tracker first: starting it
        # unblocks SIGTERM.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self._save_process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child_end.close()  # the parent's copy: a receive fails at once if the process dies
        self.started, self.closing, self.rank = False, False, dist.get_rank()
        threading.Thread(target=self._watch, daemon=True, name="distrib-ckpt-watch").start()

    def _watch(self) -> None:
        """Says at once when the process dies while this rank still needs it (a thread waiting on it): the ranks act
        on it together at the next save (ShardedStorage.write)."""
        multiprocessing.connection.wait([self._save_process.sentinel])
        if not self.closing and self.death(wait_s=DEATH_S):
            say(f"distrib: warning: {self.death()} died; the next checkpoint is written without it and starts new ones")

    def death(self, wait_s: float = 0.0) -> str | None:
        """'rank R's checkpoint process (pid P, killed by SIGKILL)' once it ended without being asked to; else None.
        wait_s: how long to wait for its end (a write that failed as the process died: its pipe closes a moment
        before its exit can be read)."""
        deadline = time.monotonic() + wait_s
        while self._save_process.exitcode is None and time.monotonic() < deadline and not self.closing:
            time.sleep(0.01)  # polled, not joined: the watching thread may be the one that reaps it
        if self.closing or self._save_process.exitcode is None:
            return None
        code = self._save_process.exitcode
        try:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        except ValueError:
            how = f"killed by signal {-code}"
        return f"rank {self.rank}'s checkpoint process (pid {self.pid}, {how})"

    @property
    def pid(self) -> int:
        return self._save_process.pid

    def ready(self) -> None:
        """Before the first save: waits until the process has started, then makes it the one torch's
        dcp.async_save(..., AsyncCheckpointerType.PROCESS) writes through."""
        if self.started:
            return
        try:
            response = self._wait_for_response(timeout=START_TIMEOUT_S)
        except RuntimeError as e:  # it died as it started: most often a script without a main guard
            raise CheckpointError(
                f"checkpoint.async_save = 'process': the checkpoint process ended as it started ({e}); a script "
                f"that trains must start it under `{GUARD}` (the process re-runs the script's top level), or use "
                "--set checkpoint.async_save=thread") from None
        if response != CheckpointSaveProcessControlOpts.INIT_COMPLETE:
            raise CheckpointError(f"checkpoint.async_save = 'process': the checkpoint process said {response!r}")
        set_checkpoint_process(self)
        self.started = True

    def close(self) -> None:
        """Ends the process once no write is in flight: a request, then SIGKILL after STOP_S (it ignores SIGTERM;
        with no write in flight it holds nothing, and tearing torch down takes it seconds)."""
        self.closing = True
        if checkpoint_process() is self:
            set_checkpoint_process(None)
        if self._save_process.is_alive():
            with contextlib.suppress(OSError):
                self._send(CheckpointSaveProcessControlOpts.TERMINATE)
            self._save_process.join(timeout=STOP_S)
        if self._save_process.is_alive():
            self._save_process.kill()
            self._save_process.join()

    def __del__(self) -> None:  # torch's sends SIGTERM, which this process ignores
        with contextlib.suppress(Exception):
            self.close()


def agree_on_writers(process: CheckpointProcess | None, error: BaseException | None) -> tuple[list[str], list[str]]:
    """Every rank (a collective): the checkpoint processes that died (CheckpointProcess.death) and the writes that
    failed ('rank R: why'), of every rank, so that all act alike."""
    died = process.death(wait_s=DEATH_S if error is not None else 0.0) if process is not None else None
    mine = [died, f"{error}" if error is not None else None]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return ([died for died, _ in every if died],
            [f"rank {rank}: {failed}" for rank, (_, failed) in enumerate(every) if failed])


def shared_stager(pin_memory: bool) -> DefaultStager:
    """Copies a save's tensors into shared memory, which the checkpoint process reads without another copy (pinned
    on CUDA, so the device-to-host copy runs at full speed); the copies are kept and reused by the next save, which
    starts only once the previous write is done (ShardedStorage.write)."""
    return DefaultStager(StagingOptions(use_pinned_memory=pin_memory, use_shared_memory=True,
                                        use_async_staging=False, use_non_blocking_copy=pin_memory))


def unguarded_script(frame=None) -> str | None:
    """The script run as __main__ when this call comes from its top level outside `if __name__ == "__main__":` (a
    process started with spawn would run that call again); None otherwise, and when it cannot tell (no file)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = frame or sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if not path or frame is None:  # a prompt, `python -c`, or a call from no top-level code of the script
        return None
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    guarded = any(isinstance(node, ast.If) and _is_main_test(node.test)
                  and node.body[0].lineno <= line <= node.body[-1].end_lineno for node in tree.body)
    return None if guarded else path


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(side) for side in (test.left, test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def in_spawned_child() -> bool:
    """Whether this is a process started with spawn, running its parent's script as __mp_main__ (a script without
    a main guard: its top level runs again here)."""
    return getattr(sys.modules.get("__main__"), "__name__", None) == "__mp_main__"
