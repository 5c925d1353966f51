"""How long `distrib plan` takes for a GPT of 1B and of 8B parameters on 128 nodes x 8 GPUs (1024 ranks), each a
fresh process as a user runs it, against the target of 60 s on 2 CPU cores (issue 17); and its peak resident memory
against one fp32 copy of the weights (the model lives on the meta device, so it must stay far below).

    python scripts/bench_plan.py [--nnodes 128] [--nproc-per-node 8] [--strategy hsdp]
Writes tiny train.bin / val.bin token files to a temporary folder (the plan reads the data as train would)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 60.0
GPTS = {"1B": "{n_layers=16, n_heads=16, dim=2048, hidden_dim=8192, tie_weights=true}",
        "8B": "{n_layers=32, n_heads=32, dim=4096, hidden_dim=14336, tie_weights=false}"}
PEAK = ("import resource, sys; from distrib.cli import main; code = main(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)")


def plan_once(root: Path, size: str, args: argparse.Namespace) -> dict:
    sets = ["data.name=tokens", f"data.root={root}", "data.vocab_size=50304", "data.seq_len=2048", "model.name=gpt",
            f"model.kwargs={GPTS[size]}", f"train.global_batch_size={args.nnodes * args.nproc_per_node}",
            "train.precision=bf16", "train.optimizer=adamw", f"dist.strategy={args.strategy}"]
    cmd = [sys.executable, "-c", PEAK, "plan", *[a for s in sets for a in ("--set", s)], "--nnodes",
           str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node), "--json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    seconds = time.perf_counter() - start
    figures = json.loads(done.stdout)
    return {"size": size, "seconds": seconds, "peak_rss_bytes": int(done.stderr.split()[-1]) * 1024, **figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nnodes", type=int, default=128)
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--strategy", default="hsdp", choices=("ddp", "fsdp", "hsdp"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as folder:
        root = Path(folder)
        world = args.nnodes * args.nproc_per_node
        np.zeros((world + 8) * 2048, dtype=np.uint16).tofile(root / "train.bin")
        np.zeros(8192, dtype=np.uint16).tofile(root / "val.bin")
        rows = [plan_once(root, size, args) for size in GPTS]
    print(f"{'model':<6} {'parameters':>12} {'seconds':>8} {'/ 60 s':>7} {'peak RSS':>10} {'/ fp32 weights':>15} "
          f"{'state/rank':>11}")
    for row in rows:
        weights = row["num_parameters"] * 4
        print(f"{row['size']:<6} {row['num_parameters'] / 1e9:>11.2f}B {row['seconds']:>8.1f} "
              f"{row['seconds'] / TARGET_SECONDS:>7.2f} {row['peak_rss_bytes'] / 2**30:>8.2f}Gi "
              f"{row['peak_rss_bytes'] / weights:>15.3f} {row['state_bytes_per_rank'] / 2**30:>9.2f}Gi")


if __name__ == "__main__":
    main()
