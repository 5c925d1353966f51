"""What each strategy costs, in one run on the CPU (gloo): per-rank parameter + gradient + optimizer bytes and samples/s
of ddp and fsdp at world sizes 1, 2 and 4, for a ~50M-parameter MLP from a model factory (this file's wide_mlp);
then the step time around checkpoint steps with synchronous and asynchronous sharded saves.

    python scripts/bench_memory.py [--steps 6] [--world-sizes 1,2,4] [--json bench_memory.json]
Each configuration is one `distrib train` run (its own launcher); the figures come from its summary.json and
metrics.jsonl. Targets (issue 11): fsdp / ddp bytes <= 0.55 at world size 2 and <= 0.3 at 4; async saves raise the
step time around a checkpoint less than synchronous ones."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
TARGETS = {2: 0.55, 4: 0.3}


def wide_mlp(width: int = 4864, depth: int = 3) -> nn.Module:
    """784 -> width, then depth-1 width x width blocks, then 10 classes: 3.8M + 2 x 23.7M + 49k = 51.2M parameters."""
    blocks = [nn.Sequential(nn.Linear(28 * 28, width), nn.ReLU())]
    blocks += [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)]
    return nn.Sequential(nn.Flatten(), *blocks, nn.Linear(width, 10))


def _train(run_dir: Path, world_size: int, overrides: list[str]) -> dict:
    """One `distrib train` run; returns its summary and its per-step lines."""
    sets = ["data.name=synthetic", "data.synthetic_train_size=2048", "data.synthetic_test_size=64",
            "data.eval_batch_size=64", "run.progress=false", "model.factory=bench_memory:wide_mlp",
            "train.optimizer=adamw", "train.lr=1e-4", "train.schedule=constant", "train.warmup_steps=1",
            "train.eval_every_epochs=0", "dist.device=cpu", "checkpoint.every_steps=0", f"run.dir={run_dir}",
            *overrides]
    cmd = [sys.executable, "-m", "distrib", "train", *[a for s in sets for a in ("--set", s)]]
    if world_size > 1:
        cmd[4:4] = ["--nproc-per-node", str(world_size)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "scripts"),
                                                        os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        sys.exit(f"bench_memory: {' '.join(cmd)} failed\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "steps": [line for line in lines if "step_time_p50_s" in line]}


def memory_table(work: Path, world_sizes: list[int], steps: int, batch: int) -> dict:
    results = {}
    print(f"{'world size':>10} {'strategy':>8} {'MiB per rank':>13} {'samples/s':>10} {'fsdp / ddp bytes':>17}")
    for world_size in world_sizes:
        for strategy in ("ddp", "fsdp"):
            run = _train(work / f"{strategy}{world_size}", world_size,
                         [f"dist.strategy={strategy}", f"train.max_steps={steps}", f"train.global_batch_size={batch}",
                          f"train.log_every={steps}", f"metrics.timing_skip_steps={min(3, steps // 2)}"])
            summary = run["summary"]
            results[f"{strategy}{world_size}"] = {"state_bytes_per_rank": summary["state_bytes_per_rank"],
                                                  "samples_per_second": summary["samples_per_second"]}
        ddp, fsdp = results[f"ddp{world_size}"], results[f"fsdp{world_size}"]
        ratio = fsdp["state_bytes_per_rank"] / ddp["state_bytes_per_rank"]
        results[f"ratio{world_size}"] = ratio
        for strategy, figures in (("ddp", ddp), ("fsdp", fsdp)):
            shown = f"{ratio:17.3f}" if strategy == "fsdp" else ""
            print(f"{world_size:>10} {strategy:>8} {figures['state_bytes_per_rank'] / 2**20:13.1f} "
                  f"{figures['samples_per_second']:10.1f}{shown}", flush=True)
    for world_size, target in TARGETS.items():
        if f"ratio{world_size}" in results:
            met = results[f"ratio{world_size}"] <= target
            print(f"target fsdp / ddp bytes <= {target} at world size {world_size}: "
                  f"{results[f'ratio{world_size}']:.3f} {'met' if met else 'NOT met'}")
    return results


def _around_checkpoints(steps: list[dict], every: int) -> tuple[float, float]:
    """Mean time of checkpoint steps and the step after each (where a wait for the previous write would land),
    and the median of the other steps."""
    near = [s["step_time_p50_s"] for s in steps if s["step"] % every in (0, 1) and s["step"] > 1]
    other = [s["step_time_p50_s"] for s in steps if s["step"] % every not in (0, 1) and s["step"] > 1]
    return statistics.fmean(near), statistics.median(other)


def async_table(work: Path, steps: int, every: int, batch: int) -> dict:
    results = {}
    print(f"\n{'fsdp, world size 2':>18} {'ckpt steps s':>12} {'other steps s':>13} {'rise s':>8}")
    for mode in ("sync", "async"):
        run = _train(work / f"ckpt_{mode}", 2,
                     ["dist.strategy=fsdp", f"train.max_steps={steps}", f"train.global_batch_size={batch}",
                      "train.log_every=1", f"checkpoint.every_steps={every}", "checkpoint.keep_last=2",
                      f"checkpoint.async_save={'thread' if mode == 'async' else 'off'}"])
        near, other = _around_checkpoints(run["steps"], every)
        results[mode] = {"checkpoint_steps_s": near, "other_steps_s": other, "rise_s": near - other}
        print(f"{mode:>18} {near:12.3f} {other:13.3f} {near - other:8.3f}", flush=True)
    met = results["async"]["rise_s"] < results["sync"]["rise_s"]
    print(f"target async rise < sync rise: {results['async']['rise_s']:.3f} s vs {results['sync']['rise_s']:.3f} s "
          f"{'met' if met else 'NOT met'}")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per memory run")
    parser.add_argument("--batch", type=int, default=16, help="global batch size (divisible by each world size)")
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--checkpoint-steps", type=int, default=16, help="steps of each checkpoint-timing run")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        results = {"memory": memory_table(Path(tmp), [int(w) for w in args.world_sizes.split(",")], args.steps,
                                          args.batch)}
        if args.checkpoint_steps:
            results["checkpoint"] = async_table(Path(tmp), args.checkpoint_steps, args.checkpoint_every, args.batch)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
