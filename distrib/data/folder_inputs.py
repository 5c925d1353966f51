"""Inputs for `distrib predict`: a folder of image files, resized and normalised as in training, as a batch source
whose targets are -1."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from distrib.config import DataConfig
from distrib.data.batching import BatchSource, Failed, LoaderBatches
from distrib.data.tensors import DataInfo, Normalizer
from distrib.distributed.runtime import Runtime
from distrib.errors import UserError


class _Unlabelled(Dataset):
    def __init__(self, paths: list[Path], channels: int, size: tuple[int, int]):
        self.paths, self.mode, self.size = paths, "L" if channels == 1 else "RGB", size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        from PIL import Image
        from torchvision.transforms import functional as F

        try:
            with Image.open(self.paths[index]) as image:
                image = image.convert(self.mode)
                if image.size != (self.size[1], self.size[0]):
                    image = image.resize((self.size[1], self.size[0]), Image.BILINEAR)
                return F.pil_to_tensor(image), -1
        except Exception as e:  # noqa: BLE001 - reported by the main process as one line
            return Failed(f"{self.paths[index]}: cannot be read as an image ({type(e).__name__}); fix: remove it")


def load_inputs(folder: Path, info: DataInfo, image_size: int | None = None, runtime: Runtime | None = None,
                num_workers: int = 0) -> tuple[list[str], BatchSource]:
    """The image files under `folder` (sorted), resized to image_size (default: the model's input size) and
    normalised as in training, as a batch source whose targets are -1."""
    from distrib.data.named import IMAGE_SUFFIXES

    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--input {str(folder)!r}: not a folder; give a folder of images (or 'test')")
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise UserError(f"--input {str(folder)!r}: holds no image files ({', '.join(IMAGE_SUFFIXES[:4])}, ...)")
    if len(info.input_shape) != 3:
        raise UserError(f"--input {str(folder)!r}: the model takes inputs of shape {list(info.input_shape)}, not "
                        "images")
    channels, height, width = info.input_shape
    size = (image_size, image_size) if image_size else (height, width)
    runtime = runtime or Runtime(0, 0, 1, 1, torch.device("cpu"), backend="none")  # no process group needed
    source = LoaderBatches(_Unlabelled(paths, channels, size), runtime, num_workers,
                           Normalizer(info.mean, info.std, uint8=True), None, DataConfig(num_workers=num_workers))
    return [str(p) for p in paths], source
