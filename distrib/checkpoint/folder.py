"""What a checkpoint.dir holds, in either format: the complete checkpoints by step (files step_N.pt, directories
step_N; step_N-RUNID beside another run's), the run id each one records, reading and removing either kind, the
folder's owner, and the temporary files of writers that died."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from distrib.checkpoint.format import NAME, CheckpointError, is_held, read_checkpoint, run_id_of, save_atomic_text
from distrib.checkpoint.shard_dir import TRAINER, WRITER, verify

# .step_00000002.pt.<run id>.<pid>.tmp (a file being written), .step_00000020.tmp/ (a directory), best_ and -RUNID
# names alike
_TEMP = re.compile(r"^\.(step|best)_\d{8}(-[0-9a-f]+)?(\.pt\..+)?\.tmp$")
OWNER_NAME = ".distrib-run"  # in checkpoint.dir: the id of the run whose checkpoints resume=auto continues


def step_of(path: Path) -> int:
    return int(NAME.match(Path(path).name).group(2))


def listing(directory: Path, prefix: str = "step") -> list[Path]:
    """Complete checkpoints of both formats and every run (temporary ones never match the name), the newest step
    first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = NAME.match(path.name)
        if match and match.group(1) == prefix and path.is_dir() != bool(match.group(4)):
            found.append(path)
    return sorted(found, key=lambda path: (step_of(path), path.name), reverse=True)


def find(directory: Path, name: str) -> Path | None:
    """The checkpoint called `name` (best_00000008, best_00000008-RUNID) in either format, if there is one."""
    for path in (Path(directory) / f"{name}.pt", Path(directory) / name):
        if path.exists():
            return path
    return None


def read_stored(path: Path, device: torch.device) -> dict:
    """The verified state of either kind: a whole file, or a directory's trainer.pt once its manifest checks out."""
    return verify(path, device) if Path(path).is_dir() else read_checkpoint(path, device)


def stored_run_id(path: Path) -> str | None:
    """The run id either kind records; None for junk, or for a checkpoint written before checkpoints had one."""
    return run_id_of(path / TRAINER) if Path(path).is_dir() else run_id_of(path)


def damaged(directory: Path) -> dict[Path, str]:
    """The checkpoints of either kind (step_ and best_) whose run id cannot be read and that fail their check (cut
    short, garbled, a directory without its trainer.pt), each with why, in one line. A whole checkpoint written
    before checkpoints had run ids is not among them; a damaged one is nobody's, so never another run's."""
    found = {}
    for path in [*listing(directory), *listing(directory, "best")]:
        if stored_run_id(path) is None:
            try:
                read_stored(path, torch.device("cpu"))
            except CheckpointError as e:
                found[path] = str(e)
    return found


def remove(path: Path) -> None:
    if Path(path).is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def remove_dead_temps(directory: Path) -> list[str]:
    """Every temporary file or directory whose writer is dead (no live process holds its lock), whichever run
    wrote it; the names removed. A writer holds its lock from before its first byte to the rename."""
    directory, removed = Path(directory), []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        if _TEMP.match(path.name) and not is_held(path / WRITER if path.is_dir() else path):
            remove(path)
            removed.append(path.name)
    return removed


def read_owner(directory: Path) -> str | None:
    """The run that owns checkpoint.dir (the last one to write a checkpoint there); None in a fresh or older folder."""
    try:
        return (Path(directory) / OWNER_NAME).read_text().strip() or None
    except OSError:
        return None


def write_owner(directory: Path, run_id: str) -> None:
    if read_owner(directory) != run_id:
        save_atomic_text(run_id + "\n", Path(directory) / OWNER_NAME)
