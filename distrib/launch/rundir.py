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


@contextlib.contextmanager
def own_folders(config, runtime) -> Iterator[None]:
    """For the run's life: rank 0 checks and locks run.dir and checkpoint.dir, and every rank raises rank 0's error
    (one collective, so no rank waits for a peer that already gave up)."""
    import torch.distributed as dist

    fds, error = [], None
    if runtime.is_main:
        # After a launcher restart the previous attempt's rank 0 may still be on its way out: give it a moment (and
        # a second anyway, for another CLI's lock probe, which holds the lock for microseconds).
        wait_s = 10.0 if runtime.restart_count else 1.0
        try:
            check_folders(config)
            for key, folder in run_folders(config):
                fds.append(lock_folder(key, folder, wait_s))
        except UserError as e:
            error = e
        except OSError as e:  # e.g. a parent folder this user may not even look into
            error = UserError(f"{e.filename}: {e.strerror}; --set run.dir (or checkpoint.dir) to a folder you own")
    verdict = [error]
    dist.broadcast_object_list(verdict, src=0)
    try:
        if verdict[0] is not None:
            raise verdict[0]
        yield
    finally:
        for fd in fds:
            os.close(fd)
