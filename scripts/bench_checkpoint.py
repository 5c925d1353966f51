"""How long a sharded checkpoint stops the training step, by checkpoint.async_save: `off` (a blocking dcp.save and the
commit), `thread` (a copy to host memory, then a thread writes) and `process` (a copy to shared memory, then the
rank's checkpoint process writes), for a 100 MB model (six 2048 x 2048 layers, fp32) under fsdp at world size 2.

    python scripts/bench_checkpoint.py [--saves 8] [--steps-between 2] [--layers 6] [--json bench_checkpoint.json]
One launch of 2 workers (torchrun) runs the three modes in turn through distrib's own checkpointer (the one
`distrib train` uses): a training step (forward, backward, SGD with momentum on a 64 x 2048 batch) --steps-between
times, then a save, --saves times. Blocked: the time save() keeps the step from going on (a wait for the previous
write included: one write at a time); median over the saves after the first (the first one of `process` may wait
for its process to start; it is printed apart). Step: the median step time while a write may run beside it.
Target (issue 38): the process save's median blocked time under 10% of the blocking save's."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_launch import launch_workers, report  # scripts/ is on the path: this file's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # measure this checkout, whichever one is installed
MODES = ("off", "thread", "process")
TARGET = 0.10


def _model(layers: int, width: int):
    import torch.nn as nn

    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _mode(runtime, mode: str, args, directory: Path) -> dict:
    """One mode's figures on this rank: blocked seconds per save, step seconds."""
    import torch

    from distrib.checkpoint import Checkpoints, ShardedStorage
    from distrib.config import DistConfig
    from distrib.distributed.parallelize import parallelize
    from distrib.distributed.strategies import make_strategy

    strategy = make_strategy(DistConfig(strategy="fsdp"), runtime.world_size, runtime.local_world_size)
    strategy.dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = parallelize(_model(args.layers, args.width), strategy.dims, strategy.config, runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    progress = {"step": 0}
    storage = ShardedStorage(runtime, async_save=mode)
    checkpointer = Checkpoints(storage, directory / mode, runtime,
                               lambda: {**strategy.training_state(model, optimizer), "progress": dict(progress)},
                               every_steps=1, keep_last=2)
    checkpointer.start()  # as training begins (distrib.checkpoint.committing)
    batch = torch.randn(64, args.width, generator=torch.Generator().manual_seed(runtime.rank))
    blocked, steps = [], []
    for _ in range(args.saves):
        for _ in range(args.steps_between):
            started = time.perf_counter()
            model(batch).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            progress["step"] += 1
            steps.append(time.perf_counter() - started)
        started = time.perf_counter()
        checkpointer.save(progress["step"])
        blocked.append(time.perf_counter() - started)
    started = time.perf_counter()
    checkpointer.close()
    return {"blocked_s": blocked, "step_s": steps, "close_s": time.perf_counter() - started}


def worker(args) -> None:
    from distrib.config import DistConfig
    from distrib.distributed.runtime import open_runtime

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as tmp, \
            open_runtime(DistConfig(device="cpu", timeout_s=600)) as runtime:
        for mode in MODES:
            results[mode] = _mode(runtime, mode, args, Path(tmp))
        if runtime.is_main:
            Path(args.out).write_text(json.dumps(results))


def summarise(results: dict) -> dict:
    summary = {}
    for mode, figures in results.items():
        summary[mode] = {"blocked_median_s": statistics.median(figures["blocked_s"][1:]),
                         "first_save_s": figures["blocked_s"][0],
                         "step_median_s": statistics.median(figures["step_s"])}
    base = summary["off"]["blocked_median_s"]
    for row in summary.values():
        row["blocked_vs_off"] = row["blocked_median_s"] / base
    return summary


def table(summary: dict, model_mb: float) -> str:
    lines = [f"fsdp, world size 2, a {model_mb:.1f} MB model (+ SGD momentum): blocked per save, median after "
             "the first",
             f"{'async_save':>10} {'blocked s':>10} {'vs off':>7} {'first save s':>13} {'step s':>7}"]
    for mode, row in summary.items():
        lines.append(f"{mode:>10} {row['blocked_median_s']:10.3f} {row['blocked_vs_off']:7.3f} "
                     f"{row['first_save_s']:13.3f} {row['step_median_s']:7.3f}")
    ratio = summary["process"]["blocked_vs_off"]
    lines.append(f"target process / off blocked < {TARGET:.2f}: {ratio:.3f} {'met' if ratio < TARGET else 'NOT met'}")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--steps-between", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    settings = ["--saves", str(args.saves), "--steps-between", str(args.steps_between), "--layers", str(args.layers),
                "--width", str(args.width)]
    results = launch_workers(__file__, 2, settings, args.timeout)
    summary = summarise(results)
    return report(args, results, summary, table(summary, args.layers * (args.width + 1) * args.width * 4 / 1e6))


if __name__ == "__main__":
    sys.exit(main())
