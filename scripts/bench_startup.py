"""What building a large model costs each rank, per strategy, on the CPU (gloo): each worker's peak resident memory
above that of the same run with a tiny GPT, divided by the model's fp32 bytes, and the time from process start to the
end of the first step; for the built-in GPT (default: dim 1024, 16 layers, 8 heads on bytes, 203M parameters), SGD
without momentum, 2 steps.

    python scripts/bench_startup.py [--world-size 4] [--strategies ddp,fsdp,hsdp,tp] [--code DIR] [--mmap-threshold N]
--code runs another checkout's distrib (e.g. the main branch, for the figures before a change). Target (issue 21):
under fsdp at world size 4, at most 1.0 for three of four workers and 2.0 for all. Each run is one torchrun of this
file as the worker, which trains through distrib.worker.train_on and writes its peak RSS (getrusage) and times."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.time()  # as near the process start as Python gets: before torch is imported
REPO = Path(__file__).resolve().parents[1]
TEXT = "/usr/share/common-licenses/GPL-3"
LARGE = "{n_layers = 16, n_heads = 8, dim = 1024}"
TINY = "{n_layers = 2, n_heads = 4, dim = 64}"
STRATEGIES = {"ddp": ["dist.strategy=ddp"], "fsdp": ["dist.strategy=fsdp"],
              "hsdp": ["dist.strategy=hsdp", "dist.shard_size=2"],
              "tp": ["dist.strategy=fsdp", "dist.tensor_parallel=2"]}


def worker(out: Path, overrides: list[str]) -> None:
    """One rank: trains, then writes OUT/rank_R.json with its peak RSS and seconds to the first step's end."""
    import resource

    from distrib.config import load_config
    from distrib.distributed.runtime import open_runtime
    from distrib.worker import train_on

    config = load_config(None, overrides)
    first = []
    with open_runtime(config.dist) as runtime:
        train_on(config, runtime, on_step_end=lambda step: first.append(time.time()) if not first else None)
        figures = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "seconds_to_first_step": first[0] - STARTED}
        (out / f"rank_{runtime.rank}.json").write_text(json.dumps(figures))


def _run(out: Path, world_size: int, kwargs: str, strategy: list[str], code: Path, mmap_threshold: int) -> list[dict]:
    out.mkdir(parents=True)
    sets = ["model.name=gpt", f"model.kwargs={kwargs}", "data.name=text", f"data.root={TEXT}", "data.seq_len=128",
            "train.optimizer=sgd", "train.momentum=0", "train.max_steps=2", "train.global_batch_size=8",
            "train.epochs=0", "train.eval_every_epochs=0", "data.eval_batch_size=8",
            "checkpoint.every_steps=0", "run.progress=false", "dist.device=cpu", f"run.dir={out / 'run'}", *strategy]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           __file__, "--worker", str(out), *sets]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    if mmap_threshold:  # glibc then returns every freed block above it (FSDP's gathered parameters) to the system
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"bench_startup: {' '.join(cmd)} failed\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(world_size)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--strategies", default="ddp,fsdp,hsdp,tp")
    parser.add_argument("--model", default=LARGE, help="the large GPT's model.kwargs")
    parser.add_argument("--code", default=str(REPO), help="the checkout whose distrib runs")
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="MALLOC_MMAP_THRESHOLD_ for the workers (0: glibc's default, whose threshold grows to "
                             "32 MiB, so freed all-gather buffers below it stay resident)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.code)
    from distrib.models.gpt import GPT

    kwargs = dict(item.split(" = ") for item in args.model.strip("{}").split(", "))
    model_bytes = 4 * sum(p.numel() for p in GPT(vocab_size=256, seq_len=128, **{k: int(v) for k, v in
                                                                                  kwargs.items()}).parameters())
    print(f"GPT {args.model}: {model_bytes / 4e6:.0f}M parameters, {model_bytes / 1e9:.2f} GB fp32; world size "
          f"{args.world_size}; {args.code}")
    print(f"{'strategy':>8} {'peak RSS above tiny / model bytes, per worker':>46} {'s to first step':>16}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        for name in args.strategies.split(","):
            large = _run(Path(tmp) / f"{name}_large", args.world_size, args.model, STRATEGIES[name], Path(args.code),
                         args.mmap_threshold)
            tiny = _run(Path(tmp) / f"{name}_tiny", args.world_size, TINY, STRATEGIES[name], Path(args.code),
                         args.mmap_threshold)
            ratios = [(a["peak_rss_bytes"] - b["peak_rss_bytes"]) / model_bytes for a, b in zip(large, tiny)]
            seconds = max(rank["seconds_to_first_step"] for rank in large)
            results[name] = {"ratios": ratios, "seconds_to_first_step": seconds,
                             "peak_rss_bytes": [rank["peak_rss_bytes"] for rank in large]}
            print(f"{name:>8} {' '.join(f'{r:5.2f}' for r in ratios):>46} {seconds:16.1f}", flush=True)
    if "fsdp" in results and args.world_size == 4:
        ratios = sorted(results["fsdp"]["ratios"])
        met = ratios[2] <= 1.0 and ratios[3] <= 2.0
        print(f"target fsdp: <= 1.0 for three of four workers and <= 2.0 for all: {'met' if met else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3:])
    else:
        main()
