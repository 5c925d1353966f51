"""distrib's trainer against a hand-written DDP loop, on identical work, at world size 1 and 2 on the CPU (gloo).

    python scripts/bench.py [--steps 200] [--repeats 7] [--world-sizes 1,2] [--json bench.json]
Each variant trains the seed Network for --steps optimizer steps of --batch samples (the first --skip steps, warm-up
and compilation, are left out of the clock); variants are interleaved, in alternating order, and the table shows
medians. Ratios: trainer / hand loop, device-resident / DataLoader data path, and each speed option / trainer."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, whichever one is installed

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
TARGET = 0.97  # trainer / hand loop and device / DataLoader must reach this
# Three clocks: samples over the summed step times (wall); batch / median step time (p50), which a shared machine's
# bursts of load disturb less; and batch / median CPU time of the training thread per step (cpu), which other
# processes on the machine hardly change at all (it leaves out gloo's threads and any wait for the other rank).
CLOCKS = ("wall", "p50", "cpu")


def hand_loop(args, runtime, images, labels) -> dict:
    """What a user writes by hand: plain DDP, the whole set as one float tensor, index slicing, SGD. The same
    initial weights, sample order and learning rate as the trainer's run, so both do the same arithmetic: the
    time a CPU step takes depends on the values (max-pool branches), not only on the shapes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distrib.models import Network

    torch.manual_seed(0)
    model = DDP(Network())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per_rank, steps_per_epoch = args.batch // runtime.world_size, len(labels) // args.batch
    ends, cpu_ends = [time.perf_counter()], [time.thread_time()]
    for step in range(args.steps):
        if step % steps_per_epoch == 0:
            order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(step // steps_per_epoch))
        start = (step % steps_per_epoch) * args.batch + runtime.rank * per_rank
        idx = order[start:start + per_rank]
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ends.append(time.perf_counter())
        cpu_ends.append(time.thread_time())
    final = loss.detach()
    torch.distributed.all_reduce(final)  # the global batch's mean loss, as the trainer logs it
    return {**_clocks(args, ends, cpu_ends), "final_loss": final.item() / runtime.world_size}


def _clocks(args, ends: list[float], cpu_ends: list[float]) -> dict:
    """samples/s on the three clocks, from the wall-clock and CPU-clock readings at the end of every step."""
    steps = [b - a for a, b in zip(ends[args.skip:], ends[args.skip + 1:])]  # end to end, data fetch included
    cpu = [b - a for a, b in zip(cpu_ends[args.skip:], cpu_ends[args.skip + 1:])]
    return {"wall": len(steps) * args.batch / sum(steps), "p50": args.batch / statistics.median(steps),
            "cpu": args.batch / statistics.median(cpu)}


def common_overrides(args, run_dir: Path) -> list[str]:
    data = [f"data.name={args.data}", f"data.synthetic_train_size={args.train_size}", "data.synthetic_test_size=1000"]
    same_as_hand = ["train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9", "train.schedule=constant",
                    "train.warmup_steps=0", "train.seed=0", "train.precision=fp32"]
    return [*data, *same_as_hand, f"data.root={args.data_root}", "data.loader=device",
            f"train.global_batch_size={args.batch}", "train.epochs=0", f"train.max_steps={args.steps}",
            "train.eval_every_epochs=0",
            f"train.log_every={args.steps}", f"metrics.timing_skip_steps={args.skip}", "run.progress=false",
            f"run.dir={run_dir}", "checkpoint.every_steps=0", "checkpoint.resume=never", "dist.device=cpu"]


def trainer_run(args, runtime, overrides: list[str], run_dir: Path) -> dict:
    """distrib's own path: load_config, then worker.train_on (data, model, DDP, Trainer.fit); its own figures."""
    from distrib.config import load_config
    from distrib.throughput import Throughput
    from distrib.worker import train_on

    config = load_config(None, [*common_overrides(args, run_dir), *overrides])
    log, cpu_ends = io.StringIO(), []
    real_step_done = Throughput.step_done

    def step_done(meter):  # the trainer's own end-of-step mark, plus a reading of this thread's CPU clock
        real_step_done(meter)
        cpu_ends.append(time.thread_time())

    try:
        with contextlib.redirect_stderr(log), mock.patch.object(Throughput, "step_done", step_done):
            summary = train_on(config, runtime)  # the log lines would bury the table
    except BaseException:
        sys.stderr.write(log.getvalue())
        raise
    cpu = _clocks(args, list(range(len(cpu_ends))), cpu_ends)["cpu"]
    return {"wall": summary["samples_per_second"], "p50": args.batch / summary["step_time_p50_s"], "cpu": cpu,
            "final_loss": summary["train_loss"]}


def measure_all(args, runtime, out_dir: Path) -> dict[str, list[dict]]:
    """Every variant, repeats times, interleaved: forward in even rounds, backward in odd ones, so neighbours in the
    list (the hand loop and the trainer, the trainer and the DataLoader path) always run back to back, and neither
    one always goes first."""
    import torch

    from distrib.config import load_config
    from distrib.data import load_splits, normalize

    train, _ = load_splits(load_config(None, common_overrides(args, out_dir)).data, runtime)
    images, labels = normalize(train.images), train.labels  # the hand loop's data: normalised once, in memory
    names = args.variants
    results: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(-args.warmup_runs, args.repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            torch.distributed.barrier()  # every rank starts each measurement together
            if VARIANTS[name] is None:
                value = hand_loop(args, runtime, images, labels)
            else:
                value = trainer_run(args, runtime, VARIANTS[name], out_dir / f"{name}-{repeat}")
            if repeat >= 0:  # negative repeats only warm the process (allocator, thread pool, compile caches)
                results[name].append(value)
    return results


def worker(args) -> None:
    """One bench process, launched like torchrun launches: distrib's runtime reads RANK, WORLD_SIZE and MASTER_*.
    Ends with barrier -> destroy (the runtime) -> os._exit, since gloo can abort in interpreter teardown."""
    import torch

    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // int(os.environ["WORLD_SIZE"])))
    from distrib.config import DistConfig
    from distrib.runtime import open_runtime

    code = 0
    try:
        with open_runtime(DistConfig(device="cpu", timeout_s=600)) as runtime, tempfile.TemporaryDirectory() as tmp:
            results = measure_all(args, runtime, Path(tmp))
            if runtime.is_main:
                Path(os.environ["BENCH_OUT"]).write_text(json.dumps(results))
    except BaseException as e:  # noqa: BLE001 - reported, then the hard exit below
        print(f"bench rank {os.environ['RANK']}: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(args, argv: list[str], world_size: int) -> dict[str, list[dict]]:
    """world_size copies of this script in worker mode, each in its own session so a timeout kills them all."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        env = {**os.environ, "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "BENCH_OUT": str(out)}
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", *argv], start_new_session=True,
                                  env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                 for rank in range(world_size)]
        deadline = time.monotonic() + args.timeout
        try:
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        if codes is None or any(codes) or not out.exists():
            raise SystemExit(f"bench: world size {world_size} failed (exit codes {codes}; see the errors above)")
        return json.loads(out.read_text())


def _ratios(by: dict[str, list[dict]], med: dict, a: str, b: str) -> dict:
    """a / b on each clock: the ratio of the medians, and the median of the repeats' own ratios ("paired": the two
    ran within the same round, minutes apart at most, so a machine that slows down for a while slows both)."""
    out = {clock: med[a][clock] / med[b][clock] for clock in CLOCKS}
    out.update({f"paired_{clock}": statistics.median(x[clock] / y[clock] for x, y in zip(by[a], by[b]))
                for clock in CLOCKS})
    return out


def summarise(args, runs: dict[int, dict[str, list[dict]]]) -> dict:
    """Medians per variant on each clock, the ratios, and whether the targets were met (paired ratios)."""
    medians = {ws: {name: {key: statistics.median(r[key] for r in values) for key in (*CLOCKS, "final_loss")}
                    for name, values in by.items()} for ws, by in runs.items()}
    ratios, targets = {}, {}
    for ws, med in medians.items():
        pairs = {**RATIOS, **{f"{name} / trainer": (name, "trainer") for name in med if VARIANTS[name]}}
        ratios[ws] = {label: _ratios(runs[ws], med, a, b)
                      for label, (a, b) in pairs.items() if a in med and b in med and a != b}
        targets[ws] = {label: {c: ratios[ws][label][f"paired_{c}"] >= TARGET for c in CLOCKS}
                       for label in RATIOS if label in ratios[ws]}
    machine = {"cpu": _cpu_name(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
               "torch": __import__("torch").__version__}
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
    return {"machine": machine, "settings": settings, "clocks": CLOCKS, "runs": runs, "median": medians,
            "ratios": ratios, "target": TARGET, "targets_met": targets}


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def table(result: dict) -> str:
    lines = [f"{'world size':>10}  {'variant':<17} {'samples/s: wall':>15} {'p50':>7} {'cpu':>7} {'final loss':>10}  "
             "runs (wall)"]
    for ws, by in result["runs"].items():
        for name, values in by.items():
            med = result["median"][ws][name]
            runs = " ".join(f"{r['wall']:.0f}" for r in values)
            lines.append(f"{ws:>10}  {name:<17} {med['wall']:>15,.0f} {med['p50']:>7,.0f} {med['cpu']:>7,.0f} "
                         f"{med['final_loss']:>10.5f}  {runs}")
    lines += ["", f"{'':>10}  {'':<42}{'ratio of medians':<21}  median of paired ratios",
              f"{'world size':>10}  {'ratio':<42}" + "".join(f"{c:>6} " for c in CLOCKS) + "  "
              + "".join(f"{c:>6} " for c in CLOCKS)]
    for ws, by in result["ratios"].items():
        lines += [f"{ws:>10}  {label:<42}" + "".join(f"{r[c]:>6.3f} " for c in CLOCKS) + "  "
                  + "".join(f"{r['paired_' + c]:>6.3f} " for c in CLOCKS) for label, r in by.items()]
    lines.append("")
    for ws, met in result["targets_met"].items():
        for label, by_clock in met.items():
            verdicts = ", ".join(f"{c} {result['ratios'][ws][label]['paired_' + c]:.3f} {'met' if ok else 'MISSED'}"
                                 for c, ok in by_clock.items())
            lines.append(f"target {label} >= {result['target']} at world size {ws} (paired): {verdicts}")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per measurement")
    parser.add_argument("--skip", type=int, default=20, help="first steps left out of the clock (warm-up, compile)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup-runs", type=int, default=1, help="untimed rounds before the repeats")
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    parser.add_argument("--data", default="synthetic", choices=("synthetic", "fashion-mnist"))
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--train-size", type=int, default=16384, help="synthetic training set size (each trainer "
                        "run builds it anew, so a small one keeps the bench short)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process; 0: cores / world size (1 keeps a shared machine from "
                             "oversubscribing its cores, where OpenMP threads wait on each other)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per world size before it is killed")
    parser.add_argument("--json", default="bench.json", help="where the result is written")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if not 0 < args.skip < args.steps - 1:
        parser.error(f"--skip {args.skip}: must be at least 1 and leave 2 timed steps of --steps ({args.steps})")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
    runs = {int(ws): run_world(args, argv, int(ws)) for ws in args.world_sizes.split(",")}
    result = summarise(args, runs)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
