"""The IDX sets, Fashion-MNIST and MNIST: found in data.root, then in the system's dataset package, then downloaded
(rank 0), unpacked into torchvision's cache folder (root/FashionMNIST/raw), checked there, and read by torchvision."""

from __future__ import annotations

import gzip
import os
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from distrib.data.tensors import FASHION_MNIST_STATS, Split
from distrib.errors import UserError

RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
# Debian's dataset-fashion-mnist package; re-gzipped, so torchvision's md5 check rejects the .gz files as they are.
SYSTEM_DIRS = {"fashion-mnist": [Path("/usr/share/datasets/fashion-mnist")], "mnist": []}


@dataclass(frozen=True)
class IdxSet:
    title: str  # as the messages name it
    folder: str  # torchvision's class and cache folder name
    stats: tuple[tuple[float, ...], tuple[float, ...]]
    hint: str  # how to get it offline

    def raw(self, root: Path) -> Path:
        return root / self.folder / "raw"

    def torchvision_class(self):
        from torchvision import datasets

        return getattr(datasets, self.folder)


SETS = {"fashion-mnist": IdxSet("Fashion-MNIST", "FashionMNIST", FASHION_MNIST_STATS,
                                "apt-get install dataset-fashion-mnist"),
        "mnist": IdxSet("MNIST", "MNIST", ((0.1307,), (0.3081,)), "put the four IDX files (.gz or not) in data.root")}


def idx_problem(path: Path, ndim: int) -> str | None:
    """None if `path` is a whole IDX file of unsigned bytes with `ndim` dimensions, else what is wrong with it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4 + 4 * ndim)
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    if len(head) < 4:
        return f"is {size} bytes long, too short for an IDX file"
    if head[:3] != b"\x00\x00\x08" or head[3] != ndim:
        return f"is not an IDX file of {ndim}-d unsigned bytes (magic number {head[:4].hex()}, want 000008{ndim:02x})"
    if len(head) < 4 + 4 * ndim:
        return f"is {size} bytes long, shorter than its header"
    dims = struct.unpack(f">{ndim}I", head[4:])
    want = 4 + 4 * ndim + _product(dims)
    if size != want:
        return f"is {size} bytes long; its header {list(dims)} says {want} (truncated or padded)"
    return None


def _product(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _ndim(name: str) -> int:
    return 3 if "images" in name else 1


def cache_problems(raw: Path) -> dict[str, str]:
    """The cached files that are missing or bad, with what is wrong; empty when the cache is whole."""
    problems = {}
    for name in RAW_FILES:
        path = raw / name
        problems[name] = "is missing" if not path.exists() else idx_problem(path, _ndim(name))
    return {name: why for name, why in problems.items() if why}


def find_sources(source: Path) -> dict[str, Path] | None:
    found = {}
    for name in RAW_FILES:
        for candidate in (source / name, source / f"{name}.gz"):
            if candidate.is_file():
                found[name] = candidate
                break
    return found if len(found) == len(RAW_FILES) else None


def _unpack(src: Path, dest: Path) -> None:
    """Copies (gunzips) src to dest through a temp name, after checking it: a bad source is the user's to fix."""
    if src.stat().st_size == 0:
        raise UserError(f"{src}: an empty file (0 bytes); fix: replace it with a good copy of the dataset file "
                        "(re-download it) or remove it")
    tmp = dest.parent / f".{dest.name}.partial"
    opener = gzip.open if src.suffix == ".gz" else open
    try:
        with opener(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{src}: not a whole gzip file ({type(e).__name__}: {e}); fix: replace it with a good copy "
                        "(re-download it) or remove it") from None
    problem = idx_problem(tmp, _ndim(dest.name))
    if problem:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{src}: {problem.replace('is ', 'unpacks to a file that is ', 1)}; fix: replace it with a "
                        "good copy of the dataset file (re-download it) or remove it")
    os.replace(tmp, dest)  # whole files only: a crash never leaves a half-unpacked IDX file


def prepare(name: str, root: Path, log: Callable[[str], None], download: Callable[[str, Path], None]) -> None:
    """Makes torchvision's raw folder under root hold whole IDX files, rebuilding bad cached ones from the source;
    raises a UserError saying where it looked otherwise."""
    spec = SETS[name]
    raw = spec.raw(root)
    problems = cache_problems(raw)
    if not problems:
        return
    bad = {file: why for file, why in problems.items() if why != "is missing"}
    if bad:
        log(f"{raw}: rebuilding bad cached files ({'; '.join(f'{file} {why}' for file, why in bad.items())})")
    for source in [root, *SYSTEM_DIRS[name]]:
        found = find_sources(source)
        if found:
            log(f"unpacking {spec.title} from {source} into {raw} (a cache; safe to delete)")
            raw.mkdir(parents=True, exist_ok=True)
            for file, src in found.items():
                _unpack(src, raw / file)
            return
    _download_or_fail(name, root, log, download)


def _download_or_fail(name: str, root: Path, log, download) -> None:
    spec = SETS[name]
    raw = spec.raw(root)
    looked = ", ".join(str(p) for p in [raw, root, *SYSTEM_DIRS[name]])
    try:
        log(f"downloading {spec.title} into {raw}")
        download(name, root)
    except Exception as e:  # noqa: BLE001 - any failure becomes the one clear message below
        raise UserError(f"data.root = {str(root)!r}: {spec.title} not found (looked in {looked}) and the download "
                        f"failed ({type(e).__name__}); fix: {spec.hint}, or put the four IDX files in {raw}, or use "
                        "--set data.name=synthetic") from None
    problems = cache_problems(raw)
    if problems:
        file, why = next(iter(problems.items()))
        raise UserError(f"{raw / file}: {why} after the download; fix: delete {raw} and run again")


def download(name: str, root: Path) -> None:
    cls = SETS[name].torchvision_class()
    for train in (True, False):
        cls(str(root), train=train, download=True)


def load(name: str, root: Path) -> tuple[Split, Split, tuple[str, ...]]:
    """(train, test, class names) through torchvision's reader, images as (N, 1, 28, 28) uint8."""
    cls = SETS[name].torchvision_class()
    splits = [cls(str(root), train=train, download=False) for train in (True, False)]
    for s in splits:
        if len(s.data) != len(s.targets):
            raise UserError(f"{SETS[name].raw(root)}: {len(s.data)} images but {len(s.targets)} labels in one split; "
                            "fix: replace the IDX files with a matching set")
    train, test = (Split(s.data.unsqueeze(1), s.targets.long()) for s in splits)
    return train, test, tuple(splits[0].classes)
