"""distrib's trainer against a hand-written DDP loop, on identical work, at world size 1 and 2 on the CPU (gloo).

    python scripts/bench.py [--steps 300] [--repeats 5] [--world-sizes 1,2] [--json bench.json]
Each variant trains the seed Network for --steps optimizer steps of --batch samples (the first --skip steps, warm-up
and compilation, are left out of the clock); variants are interleaved and rotated across repeats, and the table shows
medians. Ratios: trainer / hand loop, device-resident / DataLoader data path, and each speed option / trainer."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Variants: the hand loop, or the trainer with these --set overrides on top of the common ones.
VARIANTS = {
    "hand": None,
    "trainer": [],
    "dataloader": ["data.loader=dataloader"],
    "finite_check_off": ["train.finite_check_every=0"],
    "compile": ["speed.compile=true"],
    "channels_last": ["speed.channels_last=true"],
    "bucket_view": ["speed.gradient_as_bucket_view=true"],
    "static_graph": ["speed.static_graph=true"],
    "bucket_32kb": ["speed.bucket_cap_mb=0.03125"],  # splits the 130 kB of gradients into several buckets
}
RATIOS = {"trainer / hand": ("trainer", "hand"), "device / dataloader": ("trainer", "dataloader")}


def hand_loop(args, runtime, images, labels) -> float:
    """What a user writes by hand: plain DDP, the whole set as one float tensor, index slicing, SGD; samples/s."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distrib.models import Network

    torch.manual_seed(0)
    model = DDP(Network())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per_rank = args.batch // runtime.world_size
    steps_per_epoch = len(labels) // args.batch
    for step in range(args.steps):
        if step % steps_per_epoch == 0:
            order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(step))
        start = (step % steps_per_epoch) * args.batch + runtime.rank * per_rank
        idx = order[start:start + per_rank]
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step + 1 == args.skip:
            start_time = time.perf_counter()  # the same clock and the same skipped steps as the trainer's
    return (args.steps - args.skip) * args.batch / (time.perf_counter() - start_time)


def common_overrides(args, run_dir: Path) -> list[str]:
    data = [f"data.name={args.data}", f"data.synthetic_train_size={args.train_size}", "data.synthetic_test_size=1000"]
    return [*data, f"data.root={args.data_root}", "data.loader=device", f"train.global_batch_size={args.batch}",
            "train.epochs=0", f"train.max_steps={args.steps}", "train.eval_every_epochs=0",
            f"train.log_every={args.steps}", f"metrics.timing_skip_steps={args.skip}", "run.progress=false",
            f"run.dir={run_dir}", "checkpoint.every_steps=0", "checkpoint.resume=never", "dist.device=cpu"]


def trainer_run(args, runtime, overrides: list[str], run_dir: Path) -> float:
    """distrib's own path: load_config, then worker.train_on (data, model, DDP, Trainer.fit); its samples/s."""
    from distrib.config import load_config
    from distrib.worker import train_on

    config = load_config(None, [*common_overrides(args, run_dir), *overrides])
    return train_on(config, runtime)["samples_per_second"]


def measure_all(args, runtime, out_dir: Path) -> dict[str, list[float]]:
    """Every variant, repeats times, interleaved; the order rotates each repeat so no variant always goes first."""
    import torch

    from distrib.config import load_config
    from distrib.data import load_splits, normalize

    train, _ = load_splits(load_config(None, common_overrides(args, out_dir)).data, runtime)
    images, labels = normalize(train.images), train.labels  # the hand loop's data: normalised once, in memory
    names = args.variants
    results: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(-args.warmup_runs, args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            torch.distributed.barrier()  # both ranks start each measurement together
            if VARIANTS[name] is None:
                value = hand_loop(args, runtime, images, labels)
            else:
                value = trainer_run(args, runtime, VARIANTS[name], out_dir / f"{name}-{repeat}")
            if repeat >= 0:  # negative repeats warm the process (allocator, thread pool, compile caches)
                results[name].append(value)
    return results


def worker(rank: int, args, world_size: int, port: int, result_path: str) -> None:
    """One bench process: opens distrib's runtime, measures, and ends with barrier -> destroy -> os._exit."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // world_size))
    from distrib.config import DistConfig
    from distrib.runtime import LaunchEnv, open_runtime

    code = 0
    try:
        env = LaunchEnv(rank, rank, world_size, world_size, "127.0.0.1", port)
        with open_runtime(DistConfig(device="cpu", timeout_s=600), env) as runtime, \
                tempfile.TemporaryDirectory() as tmp:
            results = measure_all(args, runtime, Path(tmp))
            if rank == 0:
                Path(result_path).write_text(json.dumps(results))
    except BaseException as e:  # noqa: BLE001 - reported, then a hard exit (gloo can abort in teardown)
        print(f"bench rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(args, world_size: int) -> dict[str, list[float]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "results.json"
        mp.start_processes(worker, args=(args, world_size, free_port(), str(path)), nprocs=world_size,
                           start_method="spawn", join=True)
        if not path.exists():
            raise SystemExit(f"bench: world size {world_size} produced no results (see the errors above)")
        return json.loads(path.read_text())


def summarise(args, runs: dict[int, dict[str, list[float]]]) -> dict:
    medians = {ws: {name: statistics.median(values) for name, values in by.items()} for ws, by in runs.items()}
    ratios = {}
    for ws, med in medians.items():
        pairs = dict(RATIOS)
        pairs.update({f"{name} / trainer": (name, "trainer") for name in med if VARIANTS[name]})
        ratios[ws] = {label: med[a] / med[b] for label, (a, b) in pairs.items() if a in med and b in med}
    machine = {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
               "python": platform.python_version(), "torch": __import__("torch").__version__}
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    return {"machine": machine, "settings": settings, "samples_per_second": runs, "median": medians,
            "ratios": ratios}


def table(result: dict) -> str:
    lines = [f"{'world size':>10}  {'variant':<18} {'median samples/s':>16}  {'runs':<40}"]
    for ws, by in result["samples_per_second"].items():
        for name, values in by.items():
            runs = " ".join(f"{v:.0f}" for v in values)
            lines.append(f"{ws:>10}  {name:<18} {result['median'][ws][name]:>16,.0f}  {runs:<40}")
    lines.append("")
    lines.append(f"{'world size':>10}  {'ratio of medians':<28} {'value':>6}")
    for ws, by in result["ratios"].items():
        lines += [f"{ws:>10}  {label:<28} {value:>6.3f}" for label, value in by.items()]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per measurement")
    parser.add_argument("--skip", type=int, default=20, help="first steps left out of the clock (warm-up, compile)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup-runs", type=int, default=1, help="untimed rounds before the repeats")
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    parser.add_argument("--data", default="synthetic", choices=("synthetic", "fashion-mnist"))
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--train-size", type=int, default=60000, help="synthetic training set size")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores / world size)")
    parser.add_argument("--json", default="bench.json", help="where the result is written")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if not 0 < args.skip < args.steps:
        parser.error(f"--skip {args.skip}: must be between 0 and --steps ({args.steps}), exclusive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = {int(ws): run_world(args, int(ws)) for ws in args.world_sizes.split(",")}
    result = summarise(args, runs)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
