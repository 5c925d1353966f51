"""distrib's batched crop_flip against torchvision's per-sample transforms in a DataLoader, on the same work.

    python scripts/bench_augment.py [--samples 8192] [--batch 512] [--repeats 5] [--workers 0,2] [--device cpu]
The work: CIFAR-shaped uint8 images (3 x 32 x 32) in memory -> pad 4 and crop 32 x 32 at a random place, flip half of
them, normalise per channel -> float32 batches of --batch on --device. distrib: the device-resident path
(DeviceBatches with data.augment=crop_flip: one gather per batch, no per-sample Python). torchvision:
RandomCrop(32, padding=4) + RandomHorizontalFlip on each sample in a DataLoader (--workers processes), batches
collated, moved and normalised the same way. Every row runs with --threads torch threads. Medians of --repeats
passes in alternating order; the table shows samples/s and distrib / torchvision; target: at least 5x the best
torchvision row."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, whichever one is installed

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from distrib.data import Augment, BatchPlan, DeviceBatches, Normalizer, Split, epoch_steps  # noqa: E402
from distrib.distributed.runtime import Runtime  # noqa: E402

TARGET = 5.0
STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


class PerSample(Dataset):
    """What a torchvision user writes: a transform on each sample, in the DataLoader's workers."""

    def __init__(self, split: Split):
        from torchvision import transforms

        self.split = split
        self.transform = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int):
        return self.transform(self.split.inputs[index]), self.split.targets[index]


def distrib_pass(source: DeviceBatches, plan: BatchPlan, epoch: int, device: torch.device) -> int:
    count = 0
    for step in epoch_steps(source, plan, epoch):
        count += len(step[0][1])
    _sync(device)
    return count


def torchvision_pass(loader: DataLoader, normalizer: Normalizer, device: torch.device) -> int:
    count = 0
    for images, labels in loader:
        normalizer(images.to(device, non_blocking=True))
        labels.to(device, non_blocking=True)
        count += len(labels)
    _sync(device)
    return count


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def timed(fn) -> float:
    start = time.perf_counter()
    count = fn()
    return count / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", default="0,2", help="DataLoader worker counts for torchvision's rows")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every row (0 = torch's default; on a shared CPU, intra-op threads "
                             "that wait for each other swamp both rows, so 1 by default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (args.samples, 3, 32, 32), generator=g, dtype=torch.uint8),
                  torch.randint(0, 10, (args.samples,), generator=g))
    runtime = Runtime(0, 0, 1, 1, device, backend="none")  # no process group: one process, no collectives
    normalizer = Normalizer(*STATS, uint8=True)
    source = DeviceBatches(split, runtime, normalizer, Augment("crop_flip", seed=0, padding=4))
    plan = BatchPlan(args.samples, args.batch, 1, 0, 1, seed=0)
    runs = {"distrib crop_flip (device-resident, batched)": lambda epoch: distrib_pass(source, plan, epoch, device)}
    for workers in (int(w) for w in args.workers.split(",")):
        loader = DataLoader(PerSample(split), batch_size=args.batch, shuffle=True, drop_last=True,
                            num_workers=workers, persistent_workers=workers > 0, pin_memory=device.type == "cuda")
        runs[f"torchvision per-sample, {workers} workers"] = (
            lambda epoch, loader=loader: torchvision_pass(loader, normalizer, device))
    rates: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for repeat in range(-1, args.repeats):  # repeat -1 warms up (workers start, allocator, caches)
        for name in names if repeat % 2 == 0 else names[::-1]:
            rate = timed(lambda: runs[name](repeat + 1))
            if repeat >= 0:
                rates[name].append(rate)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ours = medians[names[0]]
    best = max(medians[name] for name in names[1:])
    print(f"{args.samples} samples of 3x32x32 uint8, batches of {args.batch}, device {device}, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats}")
    print(f"{'':52s} {'samples/s':>12s} {'distrib / this':>15s}")
    for name in names:
        print(f"{name:52s} {medians[name]:12.0f} {ours / medians[name]:15.2f}")
    verdict = "ok" if ours / best >= TARGET else "MISSED"
    print(f"distrib / best torchvision row: {ours / best:.2f} (target >= {TARGET:g}): {verdict}")
    return 0 if ours / best >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
