"""distrib's trainer against a hand-written DDP loop, on identical work, at world size 1 and 2 on the CPU (gloo).

    python scripts/bench.py [--steps 200] [--repeats 7] [--world-sizes 1,2] [--json bench.json]
    python scripts/bench.py --model gpt --world-sizes 1     (tokens/s of a byte-level GPT: distrib under ddp and fsdp
                                                             against a nanoGPT-style loop, and that loop under a
                                                             bare fully_shard; 5 alternating rounds)
Each variant trains the seed Network (or, --model gpt, the built-in GPT on a text file: scripts/bench_gpt.py) for
--steps optimizer steps of --batch samples (the first --skip steps, warm-up and compilation, are left out of the
clock); variants are interleaved, in alternating order, and the table shows medians. "lockstep" runs the trainer and
the hand loop a step each in turn within one run, which cancels most of a shared machine's noise. Ratios: trainer /
hand loop (separate runs, and lockstep), device-resident / DataLoader data path, and each speed option (and fsdp) /
trainer (ddp)."""

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # measure this checkout, whichever one is installed
from bench_gpt import GptFsdpHandLoop, GptHandLoop, byte_stream, docs_text, gpt_overrides  # noqa: E402 - scripts/ is on the path as __file__'s

# Variants: the hand loop, or the trainer with these --set overrides on top of the common ones.
VARIANTS = {
    "hand": None,
    "hand_fsdp": None,  # --model gpt: the hand loop under a bare fully_shard (no distrib), what fsdp can reach
    "trainer": [],
    "lockstep": None,  # the trainer and the hand loop a step each in turn, in one run: see lockstep_run
    "dataloader": ["data.loader=dataloader"],
    "finite_check_off": ["train.finite_check_every=0"],
    "compile": ["speed.compile=true"],
    "channels_last": ["speed.channels_last=true"],
    "bucket_view": ["speed.gradient_as_bucket_view=true"],
    "static_graph": ["speed.static_graph=true"],
    "bucket_32kb": ["speed.bucket_cap_mb=0.03125"],  # splits the 130 kB of gradients into several buckets
    "fsdp": ["dist.strategy=fsdp"],  # FSDP2 against the trainer's DDP
}
# --model gpt: text data has no DataLoader path; lockstep on request
GPT_VARIANTS = ("hand", "trainer", "fsdp", "hand_fsdp")
RATIOS = {"trainer / hand": ("trainer", "hand"), "trainer / hand (lockstep)": ("trainer (lockstep)", "hand (lockstep)"),
          "fsdp / hand": ("fsdp", "hand"), "hand_fsdp / hand": ("hand_fsdp", "hand"),
          "fsdp / hand_fsdp": ("fsdp", "hand_fsdp"), "device / dataloader": ("trainer", "dataloader")}
TARGET = 0.97  # trainer / hand loop and device / DataLoader must reach this
GPT_TARGET = 0.95  # --model gpt: distrib / the nanoGPT-style loop, each strategy against the loop under its parallelism
# Judged on lockstep for trainer / hand: between separate runs, seconds apart, this shared machine's speed moves by
# +-10%, more than the few per cent being judged; separate runs are still shown, as a user would time them.
TARGETS = ("trainer / hand (lockstep)", "device / dataloader")
# --model gpt: each round runs the hand loop, distrib under ddp and under fsdp back to back (alternating order), and
# the median of the rounds' own ratios is judged; a GPT step is long enough (~0.4 s) that lockstep is not needed.
# fsdp is judged against the same loop under a bare fully_shard: on a one-rank mesh FSDP2's own hooks and copies cost
# 3-7% of this small model's step, which no trainer built on FSDP2 can take back (fsdp / hand is still shown).
GPT_TARGETS = ("trainer / hand", "fsdp / hand_fsdp")
# Three clocks: samples over the summed step times (wall); batch / median step time (p50), which a shared machine's
# bursts of load disturb less; and batch / median CPU time of the training thread per step (cpu), which other
# processes on the machine hardly change at all (it leaves out gloo's threads and any wait for the other rank).
CLOCKS = ("wall", "p50", "cpu")


class HandLoop:
    """What a user writes by hand: plain DDP, the whole set as one float tensor, index slicing, SGD. The same
    initial weights, sample order and learning rate as the trainer's run, so both do the same arithmetic: the
    time a CPU step takes depends on the values (max-pool branches), not only on the shapes."""

    def __init__(self, args, runtime, images, labels):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        from distrib.models.network import Network

        torch.manual_seed(0)
        self.model = DDP(Network())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.images, self.labels, self.batch, self.rank = images, labels, args.batch, runtime.rank
        self.per_rank, self.steps_per_epoch = args.batch // runtime.world_size, len(labels) // args.batch
        self.loss = None

    def step(self, step: int) -> None:
        import torch
        import torch.nn.functional as F

        if step % self.steps_per_epoch == 0:
            seed = step // self.steps_per_epoch
            self.order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(seed))
        start = (step % self.steps_per_epoch) * self.batch + self.rank * self.per_rank
        idx = self.order[start:start + self.per_rank]
        self.loss = F.cross_entropy(self.model(self.images[idx]), self.labels[idx])
        self.optimizer.zero_grad(set_to_none=True)
        self.loss.backward()
        self.optimizer.step()

    def final_loss(self, world_size: int) -> float:
        """The last global batch's mean loss, as the trainer logs it (a collective: every rank calls it)."""
        import torch

        final = self.loss.detach()
        torch.distributed.all_reduce(final)
        return final.item() / world_size


def make_hand(args, runtime, data, fsdp: bool = False):
    """The hand loop of --model: the seed Network's on (images, labels), or the GPT's on the byte stream (fsdp: under
    a bare fully_shard)."""
    if args.model == "gpt":
        return (GptFsdpHandLoop if fsdp else GptHandLoop)(args, runtime, data)
    return HandLoop(args, runtime, *data)


def hand_loop(args, runtime, data, fsdp: bool = False) -> dict:
    hand = make_hand(args, runtime, data, fsdp)
    ends, cpu_ends = [time.perf_counter()], [time.thread_time()]
    for step in range(args.steps):
        hand.step(step)
        ends.append(time.perf_counter())
        cpu_ends.append(time.thread_time())
    return {**_clocks(args, ends, cpu_ends), "final_loss": hand.final_loss(runtime.world_size)}


def _diffs(ends: list[float]) -> list[float]:
    return [b - a for a, b in zip(ends, ends[1:])]


def _clocks(args, ends: list[float], cpu_ends: list[float]) -> dict:
    """samples/s on the three clocks, from the wall-clock and CPU-clock readings at the end of every step."""
    return _step_clocks(args, _diffs(ends), _diffs(cpu_ends))


def _rate(args, steps: list[float]) -> float:
    """batch / the median step, the first --skip steps left out (in tokens for --model gpt)."""
    return args.batch * args.unit / statistics.median(steps[args.skip:])


def _step_clocks(args, steps: list[float], cpu: list[float]) -> dict:
    """samples/s on the three clocks from per-step wall and CPU times, the first --skip steps left out."""
    timed = steps[args.skip:]  # end to end: each step's data fetch is in it
    return {"wall": len(timed) * args.batch * args.unit / sum(timed), "p50": _rate(args, steps),
            "cpu": _rate(args, cpu)}


def common_overrides(args, run_dir: Path) -> list[str]:
    data = [f"data.name={args.data}", f"data.synthetic_train_size={args.train_size}", "data.synthetic_test_size=1000",
            f"data.root={args.data_root}", "data.loader=device"]
    same_as_hand = ["train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9", "train.schedule=constant",
                    "train.warmup_steps=0", "train.seed=0", "train.precision=fp32"]
    gpt = gpt_overrides(args) if args.model == "gpt" else []  # later items win: text data, the GPT, AdamW
    return [*data, *same_as_hand, *gpt,
            f"train.global_batch_size={args.batch}", "train.epochs=0", f"train.max_steps={args.steps}",
            "train.eval_every_epochs=0",
            f"train.log_every={args.steps}", f"metrics.timing_skip_steps={args.skip}", "run.progress=false",
            f"run.dir={run_dir}", "checkpoint.every_steps=0", "checkpoint.resume=never", "dist.device=cpu"]


def _train(args, runtime, overrides: list[str], run_dir: Path, after_step) -> dict:
    """distrib's own path: load_config, then worker.train_on (data, model, DDP, Trainer.train), with after_step()
    called at the trainer's own end-of-step mark; returns its summary."""
    from distrib.config import load_config
    from distrib.worker import train_on

    config = load_config(None, [*common_overrides(args, run_dir), *overrides])
    log = io.StringIO()
    try:
        with contextlib.redirect_stderr(log):
            return train_on(config, runtime, on_step_end=lambda step: after_step())  # the log would bury the table
    except BaseException:
        sys.stderr.write(log.getvalue())
        raise


def trainer_run(args, runtime, overrides: list[str], run_dir: Path) -> dict:
    """The trainer alone; its own figures, plus a reading of this thread's CPU clock at each end-of-step mark."""
    cpu_ends = []
    summary = _train(args, runtime, overrides, run_dir, lambda: cpu_ends.append(time.thread_time()))
    return {"wall": summary["samples_per_second"] * args.unit,
            "p50": args.batch * args.unit / summary["step_time_p50_s"],
            "cpu": _rate(args, _diffs(cpu_ends)), "final_loss": summary["train_loss"]}


def lockstep_run(args, runtime, data, run_dir: Path) -> dict[str, dict]:
    """The trainer and the hand loop one step each in turn, in the same processes: the trainer's fit() runs a hand
    step from its end-of-step mark. Both then meet the same moments of a shared machine's load, which separate runs,
    seconds apart, do not; that noise (+-10% between runs here) is larger than the difference being measured.
    The trainer's step is timed from the end of the previous hand step to its own mark (its data fetch, bookkeeping
    and sync steps included); the hand step from there to its own end. Its steps also enter the trainer's own step
    times, so the trainer's summary figures are not used here."""
    hand = make_hand(args, runtime, data)
    marks = [(time.perf_counter(), time.thread_time())]  # after each trainer step, then after each hand step

    def after_step():
        marks.append((time.perf_counter(), time.thread_time()))
        hand.step((len(marks) - 2) // 2)
        marks.append((time.perf_counter(), time.thread_time()))

    summary = _train(args, runtime, [], run_dir, after_step)
    wall, cpu = (_diffs([mark[clock] for mark in marks]) for clock in (0, 1))
    # marks[0] is taken before the trainer's set-up: its first step is left out with the --skip ones
    trainer = _step_clocks(args, wall[0::2][1:], cpu[0::2][1:])
    return {"trainer (lockstep)": {**trainer, "final_loss": summary["train_loss"]},
            "hand (lockstep)": {**_step_clocks(args, wall[1::2][1:], cpu[1::2][1:]),
                                "final_loss": hand.final_loss(runtime.world_size)}}


def measure_all(args, runtime, out_dir: Path) -> dict[str, list[dict]]:
    """Every variant, repeats times, interleaved: forward in even rounds, backward in odd ones, so neighbours in the
    list (the hand loop and the trainer, the trainer and the DataLoader path) always run back to back, and neither
    one always goes first."""
    import torch

    from distrib.config import load_config
    from distrib.data import load_data

    if args.model == "gpt":
        data = byte_stream(args, runtime)  # the hand loop's data: the training bytes, in memory
    else:
        config = load_config(None, common_overrides(args, out_dir))
        train = load_data(config.data, runtime, seed=0, log=lambda _: None).train
        data = next(train.batches([torch.arange(train.num_samples)]))  # the whole set, normalised once, in memory
    names = args.variants
    results: dict[str, list[dict]] = {}
    for repeat in range(-args.warmup_runs, args.repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            torch.distributed.barrier()  # every rank starts each measurement together
            if name in ("hand", "hand_fsdp"):
                values = {name: hand_loop(args, runtime, data, fsdp=name == "hand_fsdp")}
            elif name == "lockstep":
                values = lockstep_run(args, runtime, data, out_dir / f"{name}-{repeat}")
            else:
                values = {name: trainer_run(args, runtime, VARIANTS[name], out_dir / f"{name}-{repeat}")}
            if repeat >= 0:  # negative repeats only warm the process (allocator, thread pool, compile caches)
                for key, value in values.items():
                    results.setdefault(key, []).append(value)
    return results


def worker(args, measure=measure_all) -> None:
    """One bench process, launched like torchrun launches: distrib's runtime reads RANK, WORLD_SIZE and MASTER_*;
    measure(args, runtime, folder) -> results (another script's, scripts/bench_compile.py's). Ends with barrier ->
    destroy (the runtime) -> os._exit, since gloo can abort in interpreter teardown."""
    import torch

    torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // int(os.environ["WORLD_SIZE"])))
    from distrib.config import DistConfig
    from distrib.distributed.runtime import open_runtime

    code = 0
    try:
        with open_runtime(DistConfig(device="cpu", timeout_s=600)) as runtime:
            # run_world's folder, one for every rank: a sharded run's ranks write into the same run.dir
            results = measure(args, runtime, Path(os.environ["BENCH_OUT"]).parent)
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


def run_world(args, argv: list[str], world_size: int, script: str = __file__) -> dict[str, list[dict]]:
    """world_size copies of this script (or another that runs worker()) in worker mode, each in its own session so a
    timeout kills them all."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        env = {**os.environ, "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "BENCH_OUT": str(out)}
        procs = [subprocess.Popen([sys.executable, script, "--worker", *argv], start_new_session=True,
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
    import torch

    from distrib.distributed.runtime import cpu_name

    medians = {ws: {name: {key: statistics.median(r[key] for r in values) for key in (*CLOCKS, "final_loss")}
                    for name, values in by.items()} for ws, by in runs.items()}
    ratios, targets = {}, {}
    for ws, med in medians.items():
        pairs = {**RATIOS, **{f"{name} / trainer": (name, "trainer") for name in med if VARIANTS.get(name)}}
        # fsdp's whole gap to the hand loop is torch's FSDP2 (hand_fsdp / hand) times distrib's own (fsdp / hand_fsdp)
        ratios[ws] = {label: _ratios(runs[ws], med, a, b)
                      for label, (a, b) in pairs.items() if a in med and b in med and a != b}
        judged = GPT_TARGETS if args.model == "gpt" else TARGETS
        targets[ws] = {label: {c: ratios[ws][label][f"paired_{c}"] >= args.target for c in CLOCKS}
                       for label in judged if label in ratios[ws]}
    machine = {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
               "torch": torch.__version__}
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
    return {"machine": machine, "settings": settings, "clocks": CLOCKS, "runs": runs, "median": medians,
            "ratios": ratios, "target": args.target, "targets_met": targets}


def table(result: dict) -> str:
    unit = "tokens/s" if result["settings"]["model"] == "gpt" else "samples/s"
    lines = [f"{'world size':>10}  {'variant':<19} {unit + ': wall':>15} {'p50':>7} {'cpu':>7} {'final loss':>10}  "
             "runs (wall)"]
    for ws, by in result["runs"].items():
        for name, values in by.items():
            med = result["median"][ws][name]
            runs = " ".join(f"{r['wall']:.0f}" for r in values)
            lines.append(f"{ws:>10}  {name:<19} {med['wall']:>15,.0f} {med['p50']:>7,.0f} {med['cpu']:>7,.0f} "
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
    if result["settings"]["model"] == "gpt":
        lines += ["", *_gpt_headlines(result)]
    return "\n".join(lines)


def _gpt_headlines(result: dict) -> list[str]:
    """distrib's tokens/s over the hand loop's, per strategy: the median of the rounds' own ratios."""
    lines = []
    for ws, by in result["ratios"].items():
        named = (("ddp", "trainer / hand"), ("fsdp", "fsdp / hand"), ("bare fully_shard", "hand_fsdp / hand"),
                 ("fsdp / bare fully_shard", "fsdp / hand_fsdp"))
        ratios = {name: by[label] for name, label in named if label in by}
        if not ratios:  # --variants without the hand loop, ddp or fsdp: nothing to say
            continue
        lines.append(f"distrib / hand loop tokens/s at world size {ws}, median of {result['settings']['repeats']} "
                     "alternating pairs: " + ", ".join(f"{name} {r['paired_wall']:.3f} (cpu clock "
                                                       f"{r['paired_cpu']:.3f})" for name, r in ratios.items()))
    return lines


def parse_args(argv, add_options=None):
    """bench.py's options, and another script's own (add_options(parser), scripts/bench_compile.py's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if add_options is not None:
        add_options(parser)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per measurement (default 200; "
                        "--model gpt: 100)")
    parser.add_argument("--skip", type=int, default=20, help="first steps left out of the clock (warm-up, compile)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds of every variant (default 7; --model "
                        "gpt: 5)")
    parser.add_argument("--warmup-runs", type=int, default=1, help="untimed rounds before the repeats")
    parser.add_argument("--model", default="network", choices=("network", "gpt"),
                        help="the seed Network on images, or the built-in GPT on --text (tokens/s)")
    parser.add_argument("--text", default=None,
                        help="--model gpt: the UTF-8 file it trains on (default: README.md and docs/*.md as one text)")
    parser.add_argument("--seq-len", type=int, default=64, help="--model gpt: tokens per sample")
    parser.add_argument("--batch", type=int, default=None, help="global batch size (default 128; --model gpt: 32)")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--variants", default=None,
                        help=f"subset of {','.join(VARIANTS)} (default: all; --model gpt: {','.join(GPT_VARIANTS)})")
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
    args.text = args.text or str(docs_text())
    gpt = args.model == "gpt"
    args.batch, args.steps = args.batch or (32 if gpt else 128), args.steps or (100 if gpt else 200)
    args.repeats = args.repeats or (5 if gpt else 7)
    args.unit, args.target = (args.seq_len, GPT_TARGET) if gpt else (1, TARGET)  # a sample is seq_len tokens
    network = [name for name in VARIANTS if name != "hand_fsdp"]
    args.variants = [v.strip() for v in (args.variants or ",".join(GPT_VARIANTS if gpt else network)).split(",")
                     if v.strip()]
    unknown = [v for v in args.variants if v not in (VARIANTS if gpt else network)]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if not 0 < args.skip < args.steps - 1:
        parser.error(f"--skip {args.skip}: must be at least 1 and leave 2 timed steps of --steps ({args.steps})")
    return args


def run_bench(argv: list[str], script: str = __file__, measure=measure_all, summarise=summarise,
              table=table, add_options=None) -> int:
    """A bench script's main (this one's, scripts/bench_compile.py's, whose own options add_options adds): as a
    worker, measure; else launch the workers at each world size, then write the JSON and print the table."""
    args = parse_args(argv, add_options)
    if args.worker:
        worker(args, measure)
    runs = {int(ws): run_world(args, argv, int(ws), script=script) for ws in args.world_sizes.split(",")}
    result = summarise(args, runs)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\nwritten to {args.json}")
    return 0


def main(argv=None) -> int:
    return run_bench(sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
