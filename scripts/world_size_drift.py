"""How far world sizes 1, 2 and 3 drift apart: the same config trained at each, weights compared at several steps.

    python scripts/world_size_drift.py [--steps 400] [--at 10,30,100,200,400] [--world-sizes 1,2,3]
Every world size sees the same global batches (one permutation per epoch, each rank takes its slice), so the only
difference is the order in which gloo sums the gradients: float noise that the optimizer then amplifies. Prints,
for each step, the relative L2 difference of all weights (||w_N - w_1|| / ||w_1||) against world size 1, the same
world size run twice (bitwise: 0), and each world size's test accuracy at the end."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def train(run_dir: Path, world_size: int, steps: int, every: int) -> None:
    overrides = ["data.name=synthetic", "train.global_batch_size=48", f"train.max_steps={steps}",
                 "train.eval_every_epochs=0", "train.log_every=100", "run.progress=false", "dist.device=cpu",
                 f"checkpoint.every_steps={every}", "checkpoint.keep_last=100000", f"run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           "-m", "distrib", "train", *[a for o in overrides for a in ("--set", o)]]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def weights(run_dir: Path, step: int) -> torch.Tensor:
    state = torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)
    return torch.cat([t.double().reshape(-1) for t in state["model"].values()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--at", default="10,30,100,120,150,200,400")
    parser.add_argument("--world-sizes", default="1,2,3")
    args = parser.parse_args()
    at = [int(s) for s in args.at.split(",")]
    world_sizes = [int(s) for s in args.world_sizes.split(",")]
    every = 10 if all(s % 10 == 0 for s in at) else 1
    assert max(at) <= args.steps, "--at beyond --steps"
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for ws in world_sizes:
            dirs[ws] = Path(tmp) / f"ws{ws}"
            train(dirs[ws], ws, args.steps, every)
        repeat = Path(tmp) / "repeat"
        train(repeat, world_sizes[-1], max(at), every)
        base = world_sizes[0]
        print(f"| step | {' | '.join(f'ws {ws} vs ws {base}' for ws in world_sizes[1:])} "
              f"| ws {world_sizes[-1]} run twice |")
        print("| --- " * (len(world_sizes) + 1) + "|")
        for step in at:
            ref = weights(dirs[base], step)
            cells = [f"{relative(weights(dirs[ws], step), ref):.2e}" for ws in world_sizes[1:]]
            again = relative(weights(repeat, step), weights(dirs[world_sizes[-1]], step))
            print(f"| {step} | {' | '.join(cells)} | {again:.0e} |")
        accuracy = [json.loads((dirs[ws] / "summary.json").read_text())["test_accuracy"] for ws in world_sizes]
        print(f"| test accuracy after {args.steps} steps | "
              + " | ".join(f"ws {ws}: {100 * a:.2f}%" for ws, a in zip(world_sizes, accuracy)) + " |")


if __name__ == "__main__":
    main()
