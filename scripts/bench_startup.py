"""What building a large model costs each rank, per strategy, on the CPU (gloo), for the built-in GPT (default: dim
1024, 16 layers, 8 heads on bytes, 203M parameters), SGD without momentum, 2 steps; each run is one torchrun of this
file as the worker, which trains through distrib.worker.train_on and writes its peak RSS (getrusage) and times.

    python scripts/bench_startup.py [--world-size 4] [--strategies ddp,fsdp,hsdp,tp] [--mmap-threshold N]
        per strategy: each worker's peak RSS above that of the same run with a tiny GPT, per fp32 byte of the model
        (target, issue 21: under fsdp at world size 4 at most 1.0 for three of four workers, 2.0 for all); the peak
        before the first step above the tiny run's (the fullest worker) beside `distrib plan`'s startup_bytes_per_rank
        (target: within 50%); seconds from process start to the first step (its end less the second step's time)
    python scripts/bench_startup.py --before DIR [--world-sizes 1,4] [--repeats 3]
        those seconds under fsdp (global batch 4), of DIR's checkout (e.g. a worktree of the
        commit before a change) and of this one, in alternating order; medians, and the machine's load average
--code runs another checkout's distrib in the table."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
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
SETTINGS = ["model.name=gpt", "data.name=text", f"data.root={TEXT}", "data.seq_len=128", "train.optimizer=sgd",
            "train.momentum=0", "dist.device=cpu"]


class _TrainStart:
    """Peak RSS when training starts: what building and the checks before the first step held."""

    def __init__(self, peak):
        self.peak, self.figures = peak, {}

    def on_train_start(self, model) -> None:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.figures = {"startup_peak_rss_bytes": self.peak(), "seconds_to_train_start": time.time() - STARTED,
                        "start_user_cpu_s": usage.ru_utime, "start_system_cpu_s": usage.ru_stime}


def worker(out: Path, overrides: list[str]) -> None:
    """One rank: trains, then writes OUT/rank_R.json with its peak RSS, seconds to the first step's end, each step's
    seconds and the process's user and system CPU seconds (scripts/bench_allocator.py reads those too)."""
    import resource

    from distrib.config import load_config
    from distrib.distributed.runtime import open_runtime
    from distrib.worker import train_on

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

    config = load_config(None, overrides)
    ends, start = [], _TrainStart(peak)
    # a checkout from before the training callbacks (--before) reports no start-up peak
    hooks = {"callbacks": (start,)} if "callbacks" in inspect.signature(train_on).parameters else {}
    with open_runtime(config.dist) as runtime:
        train_on(config, runtime, on_step_end=lambda step: ends.append(time.time()), **hooks)
        # the first step's end less the second step's time: the start-up, without one step's compute
        usage = resource.getrusage(resource.RUSAGE_SELF)
        figures = {"peak_rss_bytes": peak(), "seconds_to_first_step": 2 * ends[0] - ends[1] - STARTED,
                   "step_seconds": [b - a for a, b in zip(ends, ends[1:])], "user_cpu_s": usage.ru_utime,
                   "system_cpu_s": usage.ru_stime, **start.figures}
        (out / f"rank_{runtime.rank}.json").write_text(json.dumps(figures))


def _run(out: Path, world_size: int, kwargs: str, strategy: list[str], code: Path, mmap_threshold: int = 0,
         batch: int = 8, env: dict | None = None, settings: list[str] = SETTINGS, steps: int = 2) -> list[dict]:
    """One torchrun of `world_size` workers (this file's worker); env: more variables for them (an allocator)."""
    out.mkdir(parents=True)
    sets = [*settings, f"train.global_batch_size={batch}", f"model.kwargs={kwargs}", f"train.max_steps={steps}",
            "train.epochs=0", "train.eval_every_epochs=0", "data.eval_batch_size=8", "checkpoint.every_steps=0",
            "run.progress=false", f"run.dir={out / 'run'}", *strategy]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
           __file__, "--worker", str(out), *sets]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", **(env or {})}
    if mmap_threshold:  # glibc's own variable: distrib then leaves the threshold alone
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        sys.exit(f"bench_startup: {' '.join(cmd)} failed\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return [json.loads((out / f"rank_{rank}.json").read_text()) for rank in range(world_size)]


def planned_startup_bytes(world_size: int, kwargs: str, strategy: list[str]) -> int:
    """`distrib plan --json`'s startup_bytes_per_rank for this run (this checkout's plan)."""
    sets = [arg for item in [*SETTINGS, "train.global_batch_size=8", f"model.kwargs={kwargs}", *strategy]
            for arg in ("--set", item)]
    cmd = [sys.executable, "-m", "distrib", "plan", "--json", f"--world-size={world_size}", *sets]
    text = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          check=True, timeout=600).stdout
    return json.loads(text)["startup_bytes_per_rank"]


def model_bytes(kwargs: str) -> int:
    from distrib.models.gpt import GPT

    sizes = {key: int(value) for key, value in (item.split(" = ") for item in kwargs.strip("{}").split(", "))}
    return 4 * sum(p.numel() for p in GPT(vocab_size=256, seq_len=128, **sizes).parameters())


def _table_row(name: str, large: list[dict], tiny: list[dict], whole: int, planned: int) -> dict:
    ratios = [(a["peak_rss_bytes"] - b["peak_rss_bytes"]) / whole for a, b in zip(large, tiny)]
    row = {"ratios": ratios, "seconds_to_first_step": max(rank["seconds_to_first_step"] for rank in large),
           "peak_rss_bytes": [rank["peak_rss_bytes"] for rank in large], "planned_startup_bytes": planned}
    if "startup_peak_rss_bytes" in large[0]:
        row["startup_bytes"] = max(a["startup_peak_rss_bytes"] - b["startup_peak_rss_bytes"]
                                   for a, b in zip(large, tiny))
    measured = f"{row['startup_bytes'] / 1e9:9.3f}" if "startup_bytes" in row else f"{'-':>9}"
    vs = f"{planned / row['startup_bytes']:6.2f}" if "startup_bytes" in row else f"{'-':>6}"
    print(f"{name:>8} {' '.join(f'{r:5.2f}' for r in ratios):>34} {measured} {planned / 1e9:9.3f} {vs} "
          f"{row['seconds_to_first_step']:9.1f}", flush=True)
    return row


def memory_table(args) -> dict:
    whole = model_bytes(args.model)
    print(f"GPT {args.model}: {whole / 4e6:.0f}M parameters, {whole / 1e9:.2f} GB fp32; world size {args.world_size}; "
          f"{args.code}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'':>8} {'peak RSS above tiny / model bytes':>34} {'start-up GB, measured / plan':>26} {'':>6} "
          f"{'s to first':>9}\n{'strategy':>8} {'per worker':>34} {'measured':>9} {'plan':>9} {'plan/m':>6} "
          f"{'step':>9}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        for name in args.strategies.split(","):
            planned = planned_startup_bytes(args.world_size, args.model, STRATEGIES[name])
            runs = [_run(Path(tmp) / f"{name}_{size}", args.world_size, kwargs, STRATEGIES[name], Path(args.code),
                         args.mmap_threshold) for size, kwargs in (("large", args.model), ("tiny", TINY))]
            results[name] = _table_row(name, *runs, whole, planned)
    if "fsdp" in results and args.world_size == 4:
        ratios = sorted(results["fsdp"]["ratios"])
        met = ratios[2] <= 1.0 and ratios[3] <= 2.0
        print(f"target fsdp: <= 1.0 for three of four workers and <= 2.0 for all: {'met' if met else 'NOT met'}")
    return results


def startup_times(args) -> dict:
    """Process start to the first step under fsdp, before and after, alternating which goes first."""
    codes = {"before": Path(args.before), "after": Path(args.code)}
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        for world_size in map(int, args.world_sizes.split(",")):
            seconds, loads = {"before": [], "after": []}, []
            for repeat in range(args.repeats):
                for which in (("before", "after") if repeat % 2 == 0 else ("after", "before")):
                    loads.append(os.getloadavg()[0])
                    ranks = _run(Path(tmp) / f"{world_size}_{repeat}_{which}", world_size, args.model,
                                 STRATEGIES["fsdp"], codes[which], batch=4)  # the steps' compute is not timed
                    seconds[which].append(max(rank["seconds_to_first_step"] for rank in ranks))
            row = {which: statistics.median(values) for which, values in seconds.items()}
            results[world_size] = {**row, "runs": seconds, "load_average": statistics.median(loads)}
            print(f"world size {world_size}: before {row['before']:.1f} s, after {row['after']:.1f} s (medians of "
                  f"{args.repeats}: {seconds}; median load average {statistics.median(loads):.1f})", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--strategies", default="ddp,fsdp,hsdp,tp")
    parser.add_argument("--model", default=LARGE, help="the large GPT's model.kwargs")
    parser.add_argument("--code", default=str(REPO), help="the checkout whose distrib runs")
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="MALLOC_MMAP_THRESHOLD_ for the workers (0: distrib's own choice: 64 KiB under sharded "
                             "strategies for models of 64 MiB or more, on glibc)")
    parser.add_argument("--before", help="time the start-up of this checkout against --code's instead")
    parser.add_argument("--world-sizes", default="1,4", help="--before: the world sizes")
    parser.add_argument("--repeats", type=int, default=3, help="--before: runs of each checkout per world size")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.code)
    results = startup_times(args) if args.before else memory_table(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3:])
        # as distrib's worker ends: the process group is closed; torch's teardown at interpreter exit sometimes
        # aborted a worker here ("terminate called without an active exception": 1 run in 10, glibc or tcmalloc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        main()
