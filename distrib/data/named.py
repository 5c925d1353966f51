"""The other named sets: CIFAR-10 (torchvision's python-pickle batches), an ImageFolder tree (train/CLASS/*,
test/CLASS/*, any image PIL reads) and the seeded synthetic set; and telling which dataset a folder holds."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch.utils.data import Dataset

from distrib.data.batching import Failed
from distrib.data.tensors import Split
from distrib.errors import UserError

CIFAR_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch",
               "batches.meta")
CIFAR_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))  # CIFAR-10 training-set pixel statistics
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


def what_is_in(root: Path) -> tuple[str, tuple[str, ...]] | None:
    """(what, the data.name values for it) when data.root itself visibly holds a dataset, else None. torchvision's
    own subfolders (FashionMNIST/, MNIST/, cifar-10-batches-py/) do not count: one root may hold several of them."""
    if not root.is_dir():
        return None
    if (root / "data_batch_1").is_file():
        return "CIFAR-10 batches", ("cifar10",)
    if (root / "train").is_dir() and any(p.is_dir() for p in (root / "train").iterdir()):
        return "an ImageFolder tree (train/CLASS/...)", ("imagefolder",)
    if _has_images(root) or any(_has_images(p) for p in sorted(root.iterdir())[:20] if p.is_dir()):
        return "image files (imagefolder wants them in train/CLASS/ and test/CLASS/)", ("imagefolder",)
    if "train-images-idx3-ubyte" in {p.name.removesuffix(".gz") for p in root.iterdir()}:
        return "IDX files (Fashion-MNIST or MNIST)", ("fashion-mnist", "mnist")
    return None


def _has_images(folder: Path) -> bool:
    return any(p.suffix.lower() in IMAGE_SUFFIXES for p in folder.iterdir() if p.is_file())


# ---------------------------------------------------------------- CIFAR-10


def cifar_folder(root: Path) -> Path | None:
    for folder in (root / "cifar-10-batches-py", root):
        if all((folder / f).is_file() for f in CIFAR_FILES):
            return folder
    return None


def cifar_found(root: Path) -> bool:
    return cifar_folder(root) is not None


def _cifar_reader(base_folder: str):
    """torchvision's CIFAR-10 reader with the files' presence checked instead of their md5s (a second 170 MB read
    each start, and small test files in the same format could never pass it); bad files fail in the reader."""
    from torchvision.datasets import CIFAR10

    def present(self) -> bool:
        return all((Path(self.root) / self.base_folder / f).is_file() for f in CIFAR_FILES)

    return type("Cifar10", (CIFAR10,), {"base_folder": base_folder, "meta": {**CIFAR10.meta, "md5": None},
                                        "_check_integrity": present})


def load_cifar10(root: Path) -> tuple[Split, Split, tuple[str, ...]]:
    folder = cifar_folder(root)
    reader = _cifar_reader(folder.name if folder != root else ".")
    splits = []
    for train in (True, False):
        try:
            ds = reader(str(folder.parent if folder != root else root), train=train, download=False)
            images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW, uint8
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError, OSError) as e:
            raise UserError(f"data.root = {str(root)!r}: the CIFAR-10 batches in {folder} cannot be read "
                            f"({type(e).__name__}: {str(e)[:120]}); fix: replace them with the python version of "
                            "CIFAR-10 (cifar-10-python.tar.gz, unpacked)") from None
        splits.append(Split(images, torch.tensor(ds.targets, dtype=torch.long)))
    return splits[0], splits[1], tuple(ds.classes)


def download_cifar10(root: Path) -> None:
    from torchvision.datasets import CIFAR10

    CIFAR10(str(root), train=True, download=True)


# ---------------------------------------------------------------- ImageFolder


class ImageFiles(Dataset):
    """An ImageFolder split as uint8 (C, H, W) tensors, resized to image_size when it is set, grey (1 channel) when
    the first image is grey, else RGB; a file PIL cannot read becomes a Failed sample naming it, which the batch
    source raises as one line."""

    def __init__(self, folder: Path, image_size: int, first: tuple[str, tuple[int, int]] | None = None):
        from torchvision.datasets import ImageFolder

        try:
            self.inner = ImageFolder(str(folder), is_valid_file=_is_image)
        except (FileNotFoundError, OSError) as e:
            raise UserError(f"data.root: {folder} holds no images in class subfolders ({str(e)[:100]}); fix: put "
                            "images in data.root/train/CLASS/ and data.root/test/CLASS/") from None
        self.image_size = image_size
        self.classes = tuple(self.inner.classes)
        self.targets = self.inner.targets
        self.first = first or self._probe()  # (mode, size) of the first image: all become like it

    def _probe(self) -> tuple[str, tuple[int, int]]:
        from PIL import Image

        try:
            with Image.open(self.inner.samples[0][0]) as image:
                return "L" if image.mode in ("1", "L", "I", "I;16", "F") else "RGB", image.size
        except OSError:
            return "RGB", (0, 0)  # unreadable: reading it again names the file

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        path = self.inner.samples[index][0]
        try:
            return self.read(path), self.targets[index]
        except _OtherSize as e:
            return Failed(f"{path}: {e}")
        except Exception as e:  # noqa: BLE001 - reported by the main process as one line
            return Failed(f"{path}: cannot be read as an image ({type(e).__name__}: {str(e)[:100]}); fix: replace "
                          "or remove the file")

    def read(self, path: str) -> torch.Tensor:
        from PIL import Image
        from torchvision.transforms import functional as F

        mode, size = self.first
        with Image.open(path) as image:
            image = image.convert(mode) if image.mode != mode else image
            if self.image_size:
                image = image.resize((self.image_size, self.image_size), Image.BILINEAR)
            elif image.size != size:
                raise _OtherSize(f"{image.size[0]}x{image.size[1]} pixels where the first image has "
                                 f"{size[0]}x{size[1]}; fix: --set data.image_size=N resizes all images")
            return F.pil_to_tensor(image)


class _OtherSize(Exception):
    """An image whose size differs from the first one's, with data.image_size unset."""


def _is_image(path: str) -> bool:
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def imagefolder_splits(root: Path, image_size: int) -> tuple[ImageFiles, ImageFiles]:
    for split in ("train", "test"):
        if not (root / split).is_dir():
            raise UserError(f"data.root = {str(root)!r}: no {split}/ folder; fix: put images in "
                            f"{root}/train/CLASS/ and {root}/test/CLASS/ (one subfolder per class)")
    train = ImageFiles(root / "train", image_size)
    test = ImageFiles(root / "test", image_size, train.first)
    if test.classes != train.classes:
        missing = sorted(set(train.classes) ^ set(test.classes))
        raise UserError(f"data.root = {str(root)!r}: train/ and test/ have different class folders (only in one: "
                        f"{', '.join(missing[:5])}); fix: give both the same class subfolders")
    return train, test


# ---------------------------------------------------------------- synthetic


def synthetic_split(size: int, seed: int, shape: tuple[int, ...] = (1, 28, 28), num_classes: int = 10) -> Split:
    """Fixed blurry prototypes plus noise: learnable, seeded, and the same on every rank. With the default shape
    and classes these are the same bits as ever (the draws have the same count and order)."""
    g = torch.Generator().manual_seed(1234)
    prototypes = torch.rand(num_classes, *shape, generator=g)
    g.manual_seed(seed)
    labels = torch.randint(0, num_classes, (size,), generator=g)
    noisy = prototypes[labels] + 0.35 * torch.randn(size, *shape, generator=g)
    images = noisy.clamp(0, 1).mul(255).round().to(torch.uint8)
    return Split(images, labels)
