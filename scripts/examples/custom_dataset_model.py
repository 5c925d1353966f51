"""Your own Dataset, model and loss, trained by distrib.fit: a complete script to copy and change.

    python scripts/examples/custom_dataset_model.py                          # one process
    torchrun --standalone --nproc-per-node 2 scripts/examples/custom_dataset_model.py
    distrib launch --nproc-per-node 4 scripts/examples/custom_dataset_model.py --steps 500

The task: which of 4 quadrants of a noisy 1x16x16 image holds a bright square. Any map-style Dataset of
(tensor, int label) works; distrib splits each global batch over the ranks, so the result is the same (up to float
rounding) at any world size."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from distrib import fit


class Squares(Dataset):
    """Sample i: noise plus a bright 4x4 square in quadrant i % 4 (the label), at a position drawn from a seed."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = index % 4
        image = 0.3 * torch.randn(1, 16, 16, generator=g)
        row, col = (label // 2) * 8 + int(torch.randint(0, 4, (), generator=g)), (label % 2) * 8 + 2
        image[:, row:row + 4, col:col + 4] += 1.0
        return image, label


class SmallNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, width: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.head = nn.Linear(width * 4 * 4, num_classes)

    def forward(self, x):
        return self.head(F.max_pool2d(F.relu(self.conv(x)), 4).flatten(1))


def focal_loss(outputs: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Cross-entropy that down-weights easy samples: any (outputs, targets) -> scalar mean works as a loss."""
    log_p = F.log_softmax(outputs.float(), dim=1).gather(1, targets[:, None]).squeeze(1)
    return (-(1 - log_p.exp()) ** gamma * log_p).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--run-dir", default="runs/custom")
    args = parser.parse_args()

    summary = fit(lambda in_channels, num_classes: SmallNet(in_channels, num_classes),
                  Squares(2048, seed=1), Squares(512, seed=2), loss_fn=focal_loss,
                  overrides={"train.max_steps": args.steps, "train.epochs": 0, "train.global_batch_size": 64,
                             "train.optimizer": "adam", "train.lr": 3e-3, "train.warmup_steps": 10,
                             "train.log_every": 50, "run.dir": args.run_dir})
    print(f"test accuracy {summary['test_accuracy']:.3f}, test loss {summary['test_loss']:.4f}")


if __name__ == "__main__":
    main()
