"""A run's folders: checks that run.dir and checkpoint.dir can be made and written before anything is touched,
and the lock by which one run at a time owns them (flock: the kernel drops it when the holder dies, so none is stale).

Imports nothing heavy at module level: the CLI checks the folders before any worker exists."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from distrib.errors import EnvironmentFault, UserError

LOCK_NAME = ".distrib.lock"  # in run.dir and in checkpoint.dir; never part of a run's outputs


class FolderBusyError(UserError):
    """Another live run holds the folder's lock; the message names it (host, pid, since)."""


def checkpoint_dir(config) -> Path:
    return Path(config.checkpoint.dir or Path(config.run.dir) / "checkpoints")


def run_folders(config) -> list[tuple[str, Path]]:
    """(config key, folder) of every folder the run writes, each folder once."""
    folders, seen = [], set()
    for key, folder in (("run.dir", Path(config.run.dir)), ("checkpoint.dir", checkpoint_dir(config))):
        if folder.resolve() not in seen:
            seen.add(folder.resolve())
            folders.append((key, folder))
    return folders


def check_folder(key: str, folder: Path) -> None:
    """An existing folder this process may write into, or one it can create: else one line with the fix."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{key} = '{folder}': is a file, not a folder; move the file away or "
                        f"--set {key}=A_FOLDER")
    probe = folder
    while not probe.exists():  # the nearest existing ancestor is where the folder would be created
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"{key} = '{folder}': cannot be created, {probe} is a file; --set {key}=A_FOLDER")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == folder else f"cannot be created ({probe} is not writable)"
        raise UserError(f"{key} = '{folder}': {what}; fix its permissions or --set {key}=A_WRITABLE_FOLDER")


def check_folders(config, probe_locks: bool = False) -> None:
    """Every folder of the run; with probe_locks, also refuses at once a folder that a live run holds (the CLI does,
    before it starts any worker; rank 0 then takes the locks for good)."""
    for key, folder in run_folders(config):
        check_folder(key, folder)
        if probe_locks:
            _probe_lock(key, folder)


def _probe_lock(key: str, folder: Path) -> None:
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return  # no lock file (a new folder) or unreadable: rank 0's lock_folder decides
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a shared lock needs only read access, also on NFS
    except BlockingIOError:
        raise FolderBusyError(_busy(key, folder, _holder(fd))) from None
    except OSError:
        return
    finally:
        os.close(fd)


def _busy(key: str, folder: Path, holder: str) -> str:
    return (f"{key} = '{folder}': in use by another run ({holder}); wait for it to end, stop it, or give this run "
            f"another folder: --set {key}=ANOTHER_FOLDER")


def _holder(fd: int) -> str:
    """What the lock file says about its holder; it writes that just after locking, so wait a moment for it."""
    for _ in range(20):
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "holder unknown"


def lock_folder(key: str, folder: Path, wait_s: float = 0.0) -> int:
    """Creates the folder and locks it for this process (released when the fd closes or the process dies, also on
    NFS, where Linux maps flock onto a whole-file POSIX lock); the open fd. Refuses a folder that another run holds."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"{key} = '{folder}': cannot create or write it ({e.strerror}); "
                        f"--set {key}=A_WRITABLE_FOLDER") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            holder = _holder(fd)
            os.close(fd)
            raise FolderBusyError(_busy(key, folder, holder)) from None
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n".encode(), 0)
    os.fsync(fd)  # on a shared filesystem, the other nodes read it next (shared_folder_error)
    return fd


_MACHINE_FAULTS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


@contextlib.contextmanager
def environment_faults() -> Iterator[None]:
    """A write that failed for the machine (full disk, quota, read-only or failing filesystem) anywhere in the run,
    e.g. a metrics line: one line and EXIT_ENVIRONMENT instead of a traceback (checkpoints say more: see
    distrib.checkpoint.save_atomic)."""
    try:
        yield
    except OSError as e:
        if e.errno not in _MACHINE_FAULTS:
            raise
        raise EnvironmentFault(f"{e.filename or 'a file of the run'}: {e.strerror}; free some space or fix the "
                               "filesystem, then run the same command again (it resumes from the last checkpoint)"
                               ) from None


# What every rank of a sharded strategy writes into each folder: why the folder must be shared.
_WRITTEN_BY_EVERY_RANK = {"run.dir": "the run's weights (weights/)", "checkpoint.dir": "each sharded checkpoint"}


def shared_folder_error(config, runtime, folders: list[tuple[str, Path]], locked: list[str]) -> UserError | None:
    """Whether every rank sees, in each folder, the lock file rank 0 just wrote there (`locked`: what it wrote),
    i.e. the same folder: else the error every rank raises, naming the first folder some rank does not share. A
    collective."""
    import torch.distributed as dist

    seen = []
    for (_, folder), text in zip(folders, locked):
        try:
            seen.append((Path(folder) / LOCK_NAME).read_text().strip() == text)
        except OSError:  # no such file: a folder of this node's own
            seen.append(False)
    ranks = [None] * runtime.world_size
    dist.all_gather_object(ranks, (socket.gethostname(), seen))
    for index, (key, folder) in enumerate(folders):
        blind = [rank for rank, (_, sees) in enumerate(ranks) if not sees[index]]
        if blind:
            hosts = ", ".join(sorted({ranks[rank][0] for rank in blind}))
            who = (f"rank {blind[0]} (on {hosts}) does" if len(blind) == 1 else
                   f"ranks {', '.join(map(str, blind))} (on {hosts}) do")
            return UserError(f"{key} = '{folder}': {who} not see the folder rank 0 (on {ranks[0][0]}) locked; every "
                             f"rank writes its part of {_WRITTEN_BY_EVERY_RANK[key]} into it (dist.strategy = "
                             f"{config.dist.strategy}), so {key} must be one folder shared by every node: --set "
                             f"{key}=A_FOLDER_ON_A_SHARED_FILESYSTEM")
    return None


def _lock_all(config, wait_s: float) -> tuple[list[int], list[Path]]:
    """Rank 0: checks and locks every folder of the run; the open fds, and the folders it had to create."""
    check_folders(config)
    fds, created = [], []
    for key, folder in run_folders(config):
        if not folder.exists():
            created.append(folder)
        fds.append(lock_folder(key, folder, wait_s))
    return fds, created


def _unmake(created: list[Path]) -> None:
    """Rank 0, for a run refused after it locked: the folders it made go again (its lock files in them first;
    innermost first: checkpoint.dir may be inside run.dir)."""
    for folder in reversed(created):
        with contextlib.suppress(OSError):
            (folder / LOCK_NAME).unlink()
            folder.rmdir()


@contextlib.contextmanager
def own_folders(config, runtime, every_rank_writes: bool = False) -> Iterator[None]:
    """For the run's life: rank 0 checks and locks run.dir and checkpoint.dir, and every rank raises rank 0's error
    (one collective, so no rank waits for a peer that already gave up). every_rank_writes (a sharded strategy: each
    rank writes its own part of the weights and checkpoints): every rank checks that it sees the same folders."""
    import torch.distributed as dist

    fds, created, error = [], [], None
    if runtime.is_main:
        # After a launcher restart the previous attempt's rank 0 may still be on its way out: give it a moment (and
        # a second anyway, for another CLI's lock probe, which holds the lock for microseconds).
        wait_s = 10.0 if runtime.restart_count else 1.0
        try:
            fds, created = _lock_all(config, wait_s)
        except UserError as e:
            error = e
        except OSError as e:  # e.g. a parent folder this user may not even look into
            error = UserError(f"{e.filename}: {e.strerror}; --set run.dir (or checkpoint.dir) to a folder you own")
    verdict = [error, [_holder(fd) for fd in fds]]
    dist.broadcast_object_list(verdict, src=0)
    try:
        if verdict[0] is None and every_rank_writes and runtime.world_size > 1:
            verdict[0] = shared_folder_error(config, runtime, run_folders(config), verdict[1])
            if verdict[0] is not None and runtime.is_main:
                _unmake(created)
        if verdict[0] is not None:
            raise verdict[0]
        yield
    finally:
        for fd in fds:
            os.close(fd)
