"""Data-wait of a stream: the built-in GPT (scripts/bench_gpt.py's size) trained by distrib.fit on byte windows of a
text file, once from memory (the windows as tensors, device-resident) and once as a plain IterableDataset read by
2 DataLoader workers; tokens/s and data_wait_share of each, in alternating pairs, medians reported.

    python scripts/bench_stream.py [--steps 60] [--repeats 3] [--workers 2] [--json bench_stream.json]

Both runs train the same windows in the same order (the stream yields them in the memory run's first-epoch order)
from the same weights, so they end on the same loss (printed); --steps must stay within one epoch of the text."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_gpt import GPT_KWARGS, LR, docs_text  # noqa: E402 - scripts/ is on the path now

from distrib import fit  # noqa: E402
from distrib.config import TrainConfig  # noqa: E402
from distrib.data import BatchPlan  # noqa: E402
from distrib.models.gpt import GPT  # noqa: E402


class Windows(IterableDataset):
    """A plain stream of (x, y) windows: what a user's tokenized stream looks like; knows nothing of workers."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        for i in range(len(self.x)):
            yield self.x[i], self.y[i]


def windows(path: Path, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
    count = (len(data) - 1) // seq_len
    starts = torch.arange(count) * seq_len
    x = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + 1 + seq_len] for s in starts.tolist()])
    return x, y


def one_run(kind: str, args, x: torch.Tensor, y: torch.Tensor, folder: Path) -> dict:
    test = (x[:32], y[:32])
    order = BatchPlan(len(x), args.batch, 1, 0, 1, TrainConfig().seed).order(0)  # the memory run's first epoch
    train = (x, y) if kind == "memory" else Windows(x[order], y[order])
    overrides = {"train.max_steps": args.steps, "train.epochs": 0 if kind == "memory" else 1,
                 "train.global_batch_size": args.batch, "train.optimizer": "adamw", "train.lr": LR,
                 "train.weight_decay": 0.0, "train.warmup_steps": 10, "train.log_every": args.steps,
                 "data.num_classes": 256,
                 "data.num_workers": args.workers if kind == "stream" else 0, "run.progress": False,
                 "dist.device": "cpu", "checkpoint.every_steps": 0, "run.dir": str(folder / kind),
                 "data.loader": "device" if kind == "memory" else "auto"}
    torch.manual_seed(0)
    summary = fit(lambda: GPT(vocab_size=256, seq_len=args.seq_len, **GPT_KWARGS), train, test, overrides=overrides)
    return {key: summary[key] for key in ("tokens_per_second", "data_wait_share", "train_loss", "steps")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=None, help="default: README.md and docs/*.md as one text")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.text = args.text or docs_text()
    torch.set_num_threads(1)
    x, y = windows(args.text, args.seq_len)
    rows = {"memory": [], "stream": []}
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as folder:
        for repeat in range(args.repeats):
            for kind in ("memory", "stream") if repeat % 2 == 0 else ("stream", "memory"):  # alternate the order
                rows[kind].append(one_run(kind, args, x, y, Path(folder) / str(repeat)))
    result = {kind: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
              for kind, runs in rows.items()}
    ratios = [s["tokens_per_second"] / m["tokens_per_second"] for m, s in zip(rows["memory"], rows["stream"])]
    result["stream_over_memory_tokens_per_second"] = statistics.median(ratios)
    print(f"{'data':<8} {'tokens/s':>10} {'data_wait_share':>16} {'train_loss':>11}")
    for kind in ("memory", "stream"):
        r = result[kind]
        print(f"{kind:<8} {r['tokens_per_second']:>10.0f} {r['data_wait_share']:>16.3f} {r['train_loss']:>11.4f}")
    print(f"stream / memory tokens/s (median of {args.repeats} paired ratios): "
          f"{result['stream_over_memory_tokens_per_second']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"text": str(args.text), "json": str(args.json)},
                                         **result}, indent=1))


if __name__ == "__main__":
    main()
