"""Which host allocator the CPU workers should use, measured: glibc's defaults, distrib's mallopt rules
(distrib.distributed.host_heap), jemalloc and tcmalloc (preloaded), on the seed Network (configs/debug_cpu.toml's
keys), the byte GPT of scripts/bench.py and a sharded ~104M GPT (dim 768, 15 layers, AdamW, fsdp), each a torchrun
of scripts/bench_startup.py's worker. Per allocator and workload: the median step time, user and system CPU seconds
of the workers in training, and each worker's peak RSS (the sharded GPT's above the same run of a tiny GPT, per fp32
byte of the model, which is its state: parameters, gradients and two moments, over the world size of 4). The
allocators take turns in each round (the order rotates), and every figure is also given as a ratio to the first's of the
same round (steps/s: theirs over the first's), so that a machine shared with other jobs changes both sides alike.

    python scripts/bench_allocator.py [--workloads network,gpt,fsdp104m] [--allocators glibc,mallopt,jemalloc,tcmalloc]
        [--rounds 1] [--json FILE]
jemalloc and tcmalloc come from Debian's libjemalloc2 and libtcmalloc-minimal4; a missing one is left out. tcmalloc is
distrib's default (with aggressive decommit for sharded models of 64 MiB or more: distrib.distributed.host_heap),
tcmalloc_kept the same library as it comes; ratios are to the first allocator listed."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_startup import REPO, TEXT, _run  # noqa: E402 - scripts/ is on the path as __file__'s

from distrib.launch.allocator import LIBRARIES, find_library  # noqa: E402

# GLIBC_TUNABLES with a glibc.malloc key makes distrib leave glibc as it is (host_heap), and perturb=0 is its default.
# The workers are torchrun's, not distrib's launcher's, so nothing is preloaded unless LD_PRELOAD says so.
ALLOCATORS = {"glibc": {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}, "mallopt": {}}
ALLOCATORS |= {name: {"LD_PRELOAD": find_library(name) or ""} for name in LIBRARIES}
# tcmalloc as it comes: a TCMALLOC_ variable makes distrib leave it as told (no decommit for large sharded models)
ALLOCATORS["tcmalloc_kept"] = {**ALLOCATORS["tcmalloc"], "TCMALLOC_AGGRESSIVE_DECOMMIT": "false"}
NETWORK = ["data.name=synthetic", "data.synthetic_train_size=4096", "data.synthetic_test_size=64",
           "train.optimizer=sgd", "train.lr=0.05", "dist.device=cpu", "dist.strategy=ddp"]
BYTE_GPT = ["model.name=gpt", "data.name=text", f"data.root={TEXT}", "data.seq_len=64", "train.optimizer=adamw",
            "train.lr=1e-3", "train.weight_decay=0", "dist.device=cpu"]
TINY_GPT = "{n_layers = 2, n_heads = 4, dim = 64}"
# name: (world size, settings, model.kwargs, global batch, steps, the tiny model's kwargs to subtract or None)
WORKLOADS = {
    "network": (2, NETWORK, "{}", 64, 40, None),
    "gpt": (2, [*BYTE_GPT, "dist.strategy=fsdp"], "{n_layers = 4, n_heads = 4, dim = 128}", 32, 20, None),
    "fsdp104m": (4, [*BYTE_GPT, "data.seq_len=32", "dist.strategy=fsdp"], "{n_layers = 15, n_heads = 12, dim = 768}",
                 4, 3, TINY_GPT),
    # scripts/bench_startup.py's 203M GPT and settings: SGD without momentum, 8 x 128 bytes a step
    "fsdp203m": (4, [*BYTE_GPT, "data.seq_len=128", "train.optimizer=sgd", "train.momentum=0", "dist.strategy=fsdp"],
                 "{n_layers = 16, n_heads = 8, dim = 1024}", 8, 3, TINY_GPT),
}


def _figures(ranks: list[dict], tiny: list[dict] | None, model_bytes: int) -> dict:
    steps = [s for rank in ranks for s in rank["step_seconds"]]
    # CPU seconds of the workers from the start of training (the steps, not torch's import and the build)
    row = {"step_s": statistics.median(steps),
           "user_s": sum(r["user_cpu_s"] - r["start_user_cpu_s"] for r in ranks),
           "system_s": sum(r["system_cpu_s"] - r["start_system_cpu_s"] for r in ranks),
           "peak_gb": [r["peak_rss_bytes"] / 1e9 for r in ranks]}
    if tiny is not None:
        row["above_tiny_per_model"] = [(r["peak_rss_bytes"] - t["peak_rss_bytes"]) / model_bytes
                                       for r, t in zip(ranks, tiny)]
    return row


def _model_bytes(kwargs: str) -> int:
    from distrib.models.gpt import GPT

    sizes = {key: int(value) for key, value in (item.split(" = ") for item in kwargs.strip("{}").split(", "))}
    return 4 * sum(p.numel() for p in GPT(vocab_size=256, seq_len=128, **sizes).parameters())


def measure(work: Path, workload: str, allocators: list[str], rounds: int) -> dict[str, list[dict]]:
    world, settings, kwargs, batch, steps, tiny_kwargs = WORKLOADS[workload]
    model_bytes = _model_bytes(kwargs) if tiny_kwargs else 0
    rows: dict[str, list[dict]] = {name: [] for name in allocators}
    for round_ in range(rounds):
        order = allocators[round_ % len(allocators):] + allocators[:round_ % len(allocators)]
        for name in order:
            load = os.getloadavg()[0]
            run = _run(work / f"{workload}_{name}_{round_}", world, kwargs, [], REPO, batch=batch,
                       env=ALLOCATORS[name], settings=settings, steps=steps)
            tiny = _run(work / f"{workload}_{name}_{round_}_tiny", world, tiny_kwargs, [], REPO, batch=batch,
                        env=ALLOCATORS[name], settings=settings, steps=steps) if tiny_kwargs else None
            rows[name].append({**_figures(run, tiny, model_bytes), "load": load})
            print(f"  {workload} {name} round {round_}: {rows[name][-1]}", flush=True)
    return rows


def table(workload: str, rows: dict[str, list[dict]]) -> None:
    """Medians over the rounds, and each allocator's ratio to the first's in the same round (median of the ratios)."""
    first = next(iter(rows))
    base = rows[first]
    print(f"\n{workload}: {'allocator':>13} {'steps/s':>7} {'/' + first:>9} {'user s':>7} {'sys s':>6} "
          f"{'/' + first:>9} {'peak GB per worker':>24} {'above tiny / model bytes':>26} {'load':>5}")
    for name, runs in rows.items():
        def ratio(key, invert=False):
            ratios = [(b[key] / r[key]) if invert else (r[key] / b[key]) for r, b in zip(runs, base)]
            return statistics.median(ratios)
        median = {key: statistics.median(r[key] for r in runs) for key in ("step_s", "user_s", "system_s", "load")}
        peaks = " ".join(f"{p:.2f}" for p in runs[-1]["peak_gb"])
        above = " ".join(f"{p:.2f}" for p in runs[-1].get("above_tiny_per_model", []))
        print(f"{'':>{len(workload) + 1}} {name:>13} {1 / median['step_s']:7.3f} {ratio('step_s', True):9.2f} "
              f"{median['user_s']:7.1f} {median['system_s']:6.1f} {ratio('system_s'):9.2f} {peaks:>24} "
              f"{above:>26} {median['load']:5.1f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--allocators", default=",".join(ALLOCATORS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--tables-of", help="print the tables of an earlier run's --json file, and nothing else")
    args = parser.parse_args(argv)
    if args.tables_of:
        for workload, rows in json.loads(Path(args.tables_of).read_text()).items():
            table(workload, rows)
        return
    allocators = [name for name in args.allocators.split(",") if ALLOCATORS[name].get("LD_PRELOAD", True)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_allocator_") as tmp:
        for workload in args.workloads.split(","):
            results[workload] = measure(Path(tmp), workload, allocators, args.rounds)
            table(workload, results[workload])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
