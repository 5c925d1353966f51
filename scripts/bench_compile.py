"""speed.compile against eager on the built-in GPT of tests/integration/test_compile.py (4 layers, 4 heads, 64 wide,
windows of 32 bytes; the docs' bytes and AdamW as in `scripts/bench.py --model gpt`), under ddp (the whole model
compiled over DDP) and fsdp (each Block compiled in place before fully_shard), at world sizes 1 and 2 on the CPU
(gloo, one thread per rank).

    python scripts/bench_compile.py [--steps 40] [--skip 10] [--repeats 3] [--batch 16] [--world-sizes 1,2]
                                    [--strategies ddp,fsdp] [--layers 4]

Each round runs the variants (each of --strategies eager and compiled) back to back in the same worker processes
(the order alternates between rounds); the first --skip steps of each run (compiling) are untimed, and an untimed
round first fills the compile caches. The table: the median tokens/s of each variant, and compiled / eager per
strategy on bench.py's three clocks, as the ratio of the medians and the median of the rounds' own ratios (paired).
The other options are scripts/bench.py's."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402 - scripts/ is on the path as __file__'s

STRATEGIES = {"ddp": [], "fsdp": ["dist.strategy=fsdp"]}  # each compiled / eager
# bench.py's options with this script's defaults; the command line's own come after them, and win
DEFAULTS = ["--model", "gpt", "--seq-len", "32", "--batch", "16", "--steps", "40", "--skip", "10", "--repeats", "3",
            "--json", "bench_compile.json"]


def add_options(parser) -> None:
    parser.add_argument("--strategies", type=_strategies, default=list(STRATEGIES),
                        help=f"each timed eager and compiled (default: {','.join(STRATEGIES)})")
    parser.add_argument("--layers", type=int, default=4, help="the GPT's blocks (default 4)")


def _strategies(text: str) -> list[str]:
    named = [name.strip() for name in text.split(",") if name.strip()]
    if not named or any(name not in STRATEGIES for name in named):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(STRATEGIES)}")
    return named


def variants(args) -> dict[str, list[str]]:
    """Each strategy eager, then compiled, on the GPT of --layers blocks (after bench.py's own GPT keys: it wins)."""
    gpt = f"model.kwargs={{n_layers = {args.layers}, n_heads = 4, dim = 64}}"
    named = {}
    for strategy in args.strategies:
        named[strategy] = [gpt, *STRATEGIES[strategy]]
        named[f"{strategy} compiled"] = [*named[strategy], "speed.compile=true"]
    return named


def measure(args, runtime, out_dir: Path) -> dict[str, list[dict]]:
    """Every variant once per round, forward in even rounds and backward in odd ones; negative rounds warm up."""
    import torch

    results: dict[str, list[dict]] = {}
    named = variants(args)
    names = list(named)
    for repeat in range(-args.warmup_runs, args.repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            torch.distributed.barrier()  # every rank starts each measurement together
            value = bench.trainer_run(args, runtime, named[name], out_dir / f"{name.replace(' ', '_')}-{repeat}")
            if repeat >= 0:
                results.setdefault(name, []).append(value)
    return results


def summarise(args, runs: dict[int, dict[str, list[dict]]]) -> dict:
    keys = (*bench.CLOCKS, "final_loss")
    medians = {ws: {name: {key: statistics.median(r[key] for r in values) for key in keys}
                    for name, values in by.items()} for ws, by in runs.items()}
    ratios = {ws: {strategy: bench._ratios(runs[ws], med, f"{strategy} compiled", strategy)
                   for strategy in args.strategies} for ws, med in medians.items()}
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker", "variants")}
    return {"settings": settings, "clocks": bench.CLOCKS, "runs": runs, "median": medians, "ratios": ratios}


def table(result: dict) -> str:
    lines = [f"{'world size':>10}  {'variant':<14} {'tokens/s: wall':>15} {'p50':>7} {'cpu':>7} {'final loss':>10}"]
    for ws, by in result["median"].items():
        lines += [f"{ws:>10}  {name:<14} {med['wall']:>15,.0f} {med['p50']:>7,.0f} {med['cpu']:>7,.0f} "
                  f"{med['final_loss']:>10.5f}" for name, med in by.items()]
    clocks = result["clocks"]
    lines += ["", f"{'':>10}  {'':<16}{'ratio of medians':<21}  median of paired ratios",
              f"{'world size':>10}  {'compiled/eager':<16}" + "".join(f"{c:>6} " for c in clocks) + "  "
              + "".join(f"{c:>6} " for c in clocks)]
    for ws, by in result["ratios"].items():
        lines += [f"{ws:>10}  {strategy:<16}" + "".join(f"{r[c]:>6.3f} " for c in clocks) + "  "
                  + "".join(f"{r['paired_' + c]:>6.3f} " for c in clocks) for strategy, r in by.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    return bench.run_bench([*DEFAULTS, *(sys.argv[1:] if argv is None else argv)], __file__, measure, summarise,
                           table, add_options)


if __name__ == "__main__":
    sys.exit(main())
