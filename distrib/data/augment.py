"""Training augmentation as one batched computation on the device: horizontal flip and pad-and-random-crop, each
sample's draw a hash of (seed, epoch, sample index), so it is the same at any world size, on either data path and
after a resume, with no per-sample Python and no generator state to save."""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF


def _mix(x):
    """A 32-bit integer hash (lowbias32's shape, multipliers below 2**31 so int64 products never overflow); works on
    Python ints and on int64 tensors alike, with the same result on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x6C8E9CF5) & _MASK
    return x ^ (x >> 16)


def sample_key(seed: int, epoch: int) -> int:
    return _mix((_mix(seed & _MASK) ^ (epoch * 0x9E3779B1)) & _MASK)


def draws(indices: torch.Tensor, seed: int, epoch: int, stream: int) -> torch.Tensor:
    """A 32-bit random number per sample index (int64 tensor), independent for each `stream`."""
    key = _mix(sample_key(seed, epoch) ^ (stream * 0x85EBCA6B & _MASK))
    return _mix((indices.long() & _MASK) ^ key)


class Augment:
    """data.augment for 4-D image batches (B, C, H, W), applied before normalisation (padding is a zero pixel, as in
    torchvision's RandomCrop(padding=p) followed by Normalize)."""

    def __init__(self, mode: str, seed: int, padding: int = 4):
        self.mode, self.seed, self.padding = mode, seed, padding if mode == "crop_flip" else 0

    def __call__(self, images: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor:
        if self.mode == "none":
            return images
        batch, _, height, width = images.shape
        device = images.device
        flip = draws(indices, self.seed, epoch, 0) & 1  # 1: mirror this sample
        cols = torch.arange(width, device=device)
        cols = torch.where(flip[:, None].bool(), width - 1 - cols, cols)  # (B, W)
        if not self.padding:
            return images.gather(3, cols[:, None, None, :].expand(images.shape))
        span, pad = 2 * self.padding + 1, self.padding
        dy = draws(indices, self.seed, epoch, 1) % span  # the crop's top-left corner in the padded image
        dx = draws(indices, self.seed, epoch, 2) % span
        rows = torch.arange(height, device=device)[None, :] + dy[:, None]  # (B, H) in padded coordinates
        cols = cols + dx[:, None]
        padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
        # One gather for crop and flip together: for each sample its rows, then its (possibly mirrored) columns.
        out = padded.gather(2, rows[:, None, :, None].expand(batch, images.shape[1], height, padded.shape[3]))
        return out.gather(3, cols[:, None, None, :].expand(images.shape))
