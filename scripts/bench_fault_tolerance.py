"""Step time with fault-tolerant replica groups on vs off at the same world size, no failure, in one run: `distrib
train --nproc-per-node G` as one world (ddp) and with dist.fault_tolerant_groups = G (the launcher's Lighthouse and G
groups of one worker), the same model, data and steps; the ratio of the median step times.

    python scripts/bench_fault_tolerance.py --groups 2 --steps 60 [--set train.global_batch_size=1024] [--json out.json]

The groups add per step torchft's quorum and commit (round trips to the group's manager and the Lighthouse), an
all-reduce across the groups after the backward, and, on a machine whose cores the workers fill, the CPU time of
torchft's services; so the ratio depends on the step's length: the report gives the added milliseconds too."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_launch import REPO, report

SETTINGS = ["data.name=synthetic", "data.synthetic_train_size=4096", "data.synthetic_test_size=64", "train.epochs=0",
            "train.global_batch_size=64", "run.progress=false", "dist.device=cpu", "checkpoint.every_steps=0",
            "train.log_every=10"]


def _train(groups: int, steps: int, run_dir: Path, fault_tolerant: bool, timeout: float, extra: list[str]) -> dict:
    """One `distrib train --nproc-per-node groups` (as G replica groups when fault_tolerant); group 0's summary."""
    sets = [*SETTINGS, *extra, f"train.max_steps={steps}", f"run.dir={run_dir}",
            f"dist.fault_tolerant_groups={groups if fault_tolerant else 1}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    code = subprocess.run([sys.executable, "-m", "distrib", "train", "--nproc-per-node", str(groups),
                           *[arg for item in sets for arg in ("--set", item)]], env=env, timeout=timeout).returncode
    if code:
        sys.exit(f"bench_fault_tolerance: a run failed (exit {code}; see the errors above)")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3, help="alternating pairs of runs; medians of each")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for both sides (after the bench's own: 64 samples a step of the Network)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    times = {"ddp": [], "fault_tolerant": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):  # alternating, so that a busy moment of the machine falls on both
            for name in times:
                run = _train(args.groups, args.steps, Path(tmp) / f"{name}_{repeat}", name != "ddp", args.timeout,
                             args.set)
                times[name].append(run["step_time_p50_s"])
    plain, ft = (statistics.median(times[name]) for name in times)
    ratio = ft / plain
    table = (f"world size {args.groups}, {args.steps} steps, no failure, median of {args.repeats} runs"
             f"{' (' + ' '.join(args.set) + ')' if args.set else ''}\n"
             f"  ddp, one world:                    step time p50 {plain * 1e3:7.1f} ms\n"
             f"  {args.groups} fault-tolerant replica groups:  step time p50 {ft * 1e3:7.1f} ms\n"
             f"  ratio (on / off): {ratio:.2f}, {(ft - plain) * 1e3:+.1f} ms a step")
    return report(args, times, {"ratio": ratio, "added_ms": (ft - plain) * 1e3}, table)


if __name__ == "__main__":
    raise SystemExit(main())
