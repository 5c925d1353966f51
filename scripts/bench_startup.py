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
    python scripts/bench_startup.py --save [--max-shard-size 200MB] [--strategies fsdp]
        rank 0's end-of-run save against the other ranks' (issue 34), the same run with weights/ in files of at most
        model.max_shard_size (model.safetensors.index.json): each worker's peak RSS over the whole run, and the
        save's own (from the last step's end) above its RSS then; target: rank 0's peak within one file of the other
        ranks' highest; beside it what `distrib plan` counts (save_bytes_rank0)
    python scripts/bench_startup.py --plan [--allocators glibc,tcmalloc] [--tcmalloc PATH]
        `distrib plan`'s memory_bytes_per_rank against the fullest worker's peak RSS above a tiny GPT's run through
        2 AdamW steps (2 windows of 32 bytes a rank, world size 4), per host allocator (the workers' LD_PRELOAD, and
        plan told the same) and GPT: 3M, 6M and 14M under fsdp (which keep what they free), 25M under fsdp (which
        returns it), 6M and 25M under ddp; target (issue 34): within 20%
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
# --plan: GPTs under AdamW, 2 windows of 32 bytes a rank at world size 4 (global batch 8): (model.kwargs, strategy)
PLAN_SETTINGS = ["model.name=gpt", "data.name=text", f"data.root={TEXT}", "data.seq_len=32", "train.optimizer=adamw",
                 "dist.device=cpu"]
PLAN_CASES = {"3M_fsdp": ("{n_layers = 4, n_heads = 4, dim = 256}", "fsdp"),
              "6M_fsdp": ("{n_layers = 8, n_heads = 4, dim = 256}", "fsdp"),
              "14M_fsdp": ("{n_layers = 8, n_heads = 6, dim = 384}", "fsdp"),
              "25M_fsdp": ("{n_layers = 8, n_heads = 8, dim = 512}", "fsdp"),
              "6M_ddp": ("{n_layers = 8, n_heads = 4, dim = 256}", "ddp"),
              "25M_ddp": ("{n_layers = 8, n_heads = 8, dim = 512}", "ddp")}
PLAN_TINY = "{n_layers = 2, n_heads = 4, dim = 32}"


class _TrainStart:
    """Peak RSS when training starts: what building and the checks before the first step held."""

    def __init__(self, peak):
        self.peak, self.figures = peak, {}

    def on_train_start(self, model) -> None:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.figures = {"startup_peak_rss_bytes": self.peak(), "seconds_to_train_start": time.time() - STARTED,
                        "start_user_cpu_s": usage.ru_utime, "start_system_cpu_s": usage.ru_stime}


SAVE_PEAK = "BENCH_STARTUP_SAVE_PEAK"  # set: the workers also measure the end-of-run save's own peak


def _status_bytes(key: str) -> int:
    """VmHWM (the peak RSS since the last reset) or VmRSS of this process, in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key + ":"))


def worker(out: Path, overrides: list[str]) -> None:
    """One rank: trains, then writes OUT/rank_R.json with its peak RSS (before the end-of-run save and after it),
    seconds to the first step's end, each step's seconds and the process's user and system CPU seconds
    (scripts/bench_allocator.py reads those too); under SAVE_PEAK also the save's own peak and its RSS before."""
    import resource

    from distrib.config import load_config
    from distrib.distributed.runtime import open_runtime
    from distrib.worker import train_on

    def peak() -> int:
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _status_bytes("VmHWM"), seen[0])

    config = load_config(None, overrides)
    save_peak = bool(os.environ.get(SAVE_PEAK))
    ends, seen, start, rss_then = [], [0], _TrainStart(peak), [0]

    def step_end(step: int) -> None:
        ends.append(time.time())
        seen[0] = peak()  # what training held so far, before the end-of-run save
        if save_peak:  # VmHWM from here: the save's own peak (a reset lowers ru_maxrss too: seen keeps the run's)
            rss_then[0] = _status_bytes("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")

    # a checkout from before the training callbacks (--before) reports no start-up peak
    hooks = {"callbacks": (start,)} if "callbacks" in inspect.signature(train_on).parameters else {}
    with open_runtime(config.dist) as runtime:
        train_on(config, runtime, on_step_end=step_end, **hooks)
        # the first step's end less the second step's time: the start-up, without one step's compute
        usage = resource.getrusage(resource.RUSAGE_SELF)
        saved = {"save_peak_rss_bytes": _status_bytes("VmHWM"), "rss_before_save_bytes": rss_then[0]}
        figures = {"peak_rss_bytes": peak(), "peak_rss_before_save_bytes": seen[0], **(saved if save_peak else {}),
                   "seconds_to_first_step": 2 * ends[0] - ends[1] - STARTED,
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


def planned(world_size: int, kwargs: str, strategy: list[str], settings: list[str] = SETTINGS, batch: int = 8,
            env: dict | None = None) -> dict:
    """`distrib plan --json`'s figures for this run (this checkout's plan); env: its allocator's variables."""
    sets = [arg for item in [*settings, f"train.global_batch_size={batch}", f"model.kwargs={kwargs}", *strategy]
            for arg in ("--set", item)]
    cmd = [sys.executable, "-m", "distrib", "plan", "--json", f"--world-size={world_size}", *sets]
    text = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, capture_output=True,
                          text=True, check=True, timeout=600).stdout
    return json.loads(text)


def planned_startup_bytes(world_size: int, kwargs: str, strategy: list[str]) -> int:
    return planned(world_size, kwargs, strategy)["startup_bytes_per_rank"]


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


def save_table(args) -> dict:
    """Rank 0's end-of-run save beside the other ranks' (issue 34): peaks over the run and the save's own."""
    from distrib.config import file_size

    whole, file_bytes = model_bytes(args.model), file_size(args.max_shard_size)
    print(f"GPT {args.model}: {whole / 4e6:.0f}M parameters, {whole / 1e9:.2f} GB fp32; world size {args.world_size};"
          f" weights/ in files of at most {args.max_shard_size} ({file_bytes / 1e9:.3f} GB)")
    print(f"{'strategy':>8} {'peak RSS GB per worker':>24} {'save above its RSS, GB':>24} {'rank 0 - others':>15} "
          f"{'files':>6} {'plan':>6} weights/")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        for name in args.strategies.split(","):
            strategy = [*STRATEGIES[name], f"model.max_shard_size={args.max_shard_size}"]
            ranks = _run(Path(tmp) / name, args.world_size, args.model, strategy, Path(args.code),
                         env={SAVE_PEAK: "1"})
            files = sorted(path.name for path in (Path(tmp) / name / "run" / "weights").iterdir())
            plan = planned(args.world_size, args.model, strategy)["save_bytes_rank0"]
            results[name] = _save_row(name, ranks, file_bytes, plan, files)
    return results


def _save_row(name: str, ranks: list[dict], file_bytes: int, plan: int, files: list[str]) -> dict:
    peaks = [rank["peak_rss_bytes"] for rank in ranks]
    rises = [rank["save_peak_rss_bytes"] - rank["rss_before_save_bytes"] for rank in ranks]
    above = peaks[0] - max(peaks[1:])
    index = ", model.safetensors.index.json" if "model.safetensors.index.json" in files else ""
    print(f"{name:>8} {' '.join(f'{p / 1e9:5.2f}' for p in peaks):>24} "
          f"{' '.join(f'{r / 1e9:5.2f}' for r in rises):>24} {above / 1e9:15.3f} {above / file_bytes:6.2f} "
          f"{plan / 1e9:6.3f} {len(files)} files{index}", flush=True)
    print(f"target {name}: rank 0's peak within one file of the other ranks': "
          f"{'met' if above <= file_bytes else 'NOT met'}")
    return {"peak_rss_bytes": peaks, "save_rise_bytes": rises, "rank0_above_others_bytes": above,
            "in_files": above / file_bytes, "planned_save_bytes_rank0": plan, "weights": files}


def _allocators(names: list[str], tcmalloc: str | None) -> dict[str, dict]:
    """The workers' and plan's environment per host allocator: glibc (plan told so, wherever the launcher would
    preload another), tcmalloc preloaded (where installed, or at --tcmalloc); a missing one is left out."""
    from distrib.launch.allocator import find_library

    found = {"glibc": {"DISTRIB_HOST_ALLOCATOR": "glibc"}}
    path = tcmalloc or find_library("tcmalloc")
    if path:
        found["tcmalloc"] = {"LD_PRELOAD": path}
    for name in names:
        if name not in found:
            print(f"{name}: not found, left out (apt-get install libtcmalloc-minimal4, or --tcmalloc PATH)")
    return {name: found[name] for name in names if name in found}


def plan_table(args) -> dict:
    """distrib plan's step peak against the fullest worker's peak RSS above a tiny GPT's run, per allocator."""
    print(f"{'allocator':>9} {'GPT':>9} {'plan MiB':>9} {'measured MiB per worker':>28} {'plan / max':>10} "
          f"{'slack MiB':>9} host allocator (plan's)")
    results, met = {}, True
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        for allocator, env in _allocators(args.allocators.split(","), args.tcmalloc).items():
            tiny = {}
            for name, (kwargs, strategy) in PLAN_CASES.items():
                sets = [f"dist.strategy={strategy}"]
                if strategy not in tiny:
                    tiny[strategy] = _run(Path(tmp) / f"tiny_{strategy}_{allocator}", args.world_size, PLAN_TINY, sets,
                                          Path(args.code), env=env, settings=PLAN_SETTINGS)
                ranks = _run(Path(tmp) / f"{name}_{allocator}", args.world_size, kwargs, sets, Path(args.code),
                             env=env, settings=PLAN_SETTINGS)
                above = [(r["peak_rss_before_save_bytes"] - t["peak_rss_before_save_bytes"]) / 2**20
                         for r, t in zip(ranks, tiny[strategy])]
                plan = planned(args.world_size, kwargs, sets, PLAN_SETTINGS, env=env)
                ratio = plan["memory_bytes_per_rank"] / 2**20 / max(above)
                met = met and abs(ratio - 1) <= 0.2
                print(f"{allocator:>9} {name:>9} {plan['memory_bytes_per_rank'] / 2**20:9.1f} "
                      f"{' '.join(f'{a:6.1f}' for a in above):>28} {ratio:10.2f} "
                      f"{plan['allocator_slack_bytes_per_rank'] / 2**20:9.1f} {plan['host_allocator']}", flush=True)
                results[f"{allocator}_{name}"] = {"planned_bytes": plan["memory_bytes_per_rank"],
                                                  "measured_mib": above, "ratio": ratio}
    print(f"target: plan within 20% of the fullest worker's peak, each allocator and GPT: "
          f"{'met' if met else 'NOT met'}")
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
    parser.add_argument("--save", action="store_true", help="rank 0's end-of-run save against the other ranks' "
                                                                 "(--strategies default: fsdp)")
    parser.add_argument("--max-shard-size", default="200MB", help="--save: model.max_shard_size of the run")
    parser.add_argument("--plan", action="store_true", help="distrib plan's step peak against the measured one")
    parser.add_argument("--allocators", default="glibc,tcmalloc", help="--plan: the host allocators")
    parser.add_argument("--tcmalloc", help="--plan: tcmalloc's library, where it is not installed")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.code)
    if args.save and args.strategies == parser.get_default("strategies"):
        args.strategies = "fsdp"
    results = startup_times(args) if args.before else save_table(args) if args.save else \
        plan_table(args) if args.plan else memory_table(args)
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
