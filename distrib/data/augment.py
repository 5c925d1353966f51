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
        batch, channels, height, width = images.shape
        pad, device = self.padding, images.device
        flip = draws(indices, self.seed, epoch, 0) & 1  # 1: mirror this sample
        cols = torch.arange(width, device=device)
        cols = torch.where(flip[:, None].bool(), width - 1 - cols, cols)  # (B, W)
        rows = torch.arange(height, device=device).expand(batch, height)  # (B, H)
        if pad:
            span = 2 * pad + 1  # the crop's top-left corner in the padded image: 0..2 * pad in each direction
            rows = rows + (draws(indices, self.seed, epoch, 1) % span)[:, None]
            cols = cols + (draws(indices, self.seed, epoch, 2) % span)[:, None]
            images = torch.nn.functional.pad(images, (pad, pad, pad, pad))
        # One gather does crop and flip: each output pixel's place in its (padded) image, the same for all channels.
        padded_width = width + 2 * pad
        flat = (rows[:, :, None] * padded_width + cols[:, None, :]).view(batch, 1, height * width)
        out = images.reshape(batch, channels, -1).gather(2, flat.expand(batch, channels, height * width))
        return out.view(batch, channels, height, width)
