"""Pipeline parallel against fsdp at world size 4 on the CPU (gloo): the same GPT on the same batches under fsdp 4 and
under pp 2 x fsdp 2 (1f1b, and interleaved 1f1b with 2 stages per rank); tokens/s of each and their ratios, paired
round by round, and each pipeline rank's measured idle share beside distrib plan's bubble share.

    python scripts/bench_pipeline.py [--steps 12] [--skip 4] [--rounds 2] [--layers 8] [--dim 256] [--seq-len 128]
                                     [--batch 16] [--microbatches 4] [--json bench_pipeline.json]
One launch of 4 workers (torchrun) runs every variant in turn, --rounds times in alternating order (a shared machine's
load then meets each variant alike); a round's ratios are taken within it. Idle share: 1 - the time a pipeline rank
spends in its stages' forward and backward chunks (torch's PipelineStage.forward_one_chunk and backward_one_chunk,
timed from after the first step, when the schedule exists) / the time of its schedule's steps; what is left is the
bubble, waiting for the neighbouring stage's activations and gradients, and the stage's closing gradient
reduce-scatter. plan's bubble: (P - 1) / (M + P - 1), interleaved (P - 1) / (V M + P - 1)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench_launch import launch_workers, report  # scripts/ is on the path: this file's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # measure this checkout, whichever one is installed
# name -> the --set overrides on top of the common ones (fsdp at world size 4)
VARIANTS = {"fsdp 4": [],
            "pp 2 x fsdp 2, 1f1b": ["dist.pipeline_parallel=2", "dist.pipeline_schedule=1f1b"],
            "pp 2 x fsdp 2, interleaved": ["dist.pipeline_parallel=2", "dist.pipeline_schedule=interleaved_1f1b"]}


class StageClock:
    """A distrib callback: from the end of the first step (torch builds its schedule there), times this rank's stages'
    forward and backward chunks and its schedule's steps; the steps after `skip` are kept."""

    def __init__(self, skip: int):
        self.skip, self.model = skip, None
        self.running = {"busy": 0.0, "schedule": 0.0}
        self.kept = {"busy": 0.0, "schedule": 0.0}

    def on_train_start(self, model) -> None:
        self.model = model

    def on_step_end(self, step: int, loss) -> None:
        if step == 1:  # instance attributes: only this run's schedule is timed, torch's classes are untouched
            schedule = self.model.pipeline.schedule
            for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
                stage.forward_one_chunk = self._timed(stage.forward_one_chunk, "busy")
                stage.backward_one_chunk = self._timed(stage.backward_one_chunk, "busy")
            schedule.step = self._timed(schedule.step, "schedule")
        if step > self.skip:
            for key, seconds in self.running.items():
                self.kept[key] += seconds
        self.running = dict.fromkeys(self.running, 0.0)

    def _timed(self, function, key: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.running[key] += time.perf_counter() - start
        return timed

    def idle_share(self) -> float:
        return 1 - self.kept["busy"] / self.kept["schedule"]


def overrides(args, run_dir: Path) -> list[str]:
    from bench_gpt import docs_text

    kwargs = f"{{n_layers = {args.layers}, n_heads = {args.heads}, dim = {args.dim}, tie_weights = false}}"
    return ["model.name=gpt", f"model.kwargs={kwargs}", "data.name=text", f"data.root={docs_text()}",
            f"data.seq_len={args.seq_len}", "train.optimizer=adamw", "train.lr=1e-3", "train.weight_decay=0.0",
            "train.schedule=constant", "train.warmup_steps=0", f"train.global_batch_size={args.batch}",
            "train.epochs=0", f"train.max_steps={args.steps}", "train.eval_every_epochs=0",
            f"train.log_every={args.steps}", f"metrics.timing_skip_steps={args.skip}", "run.progress=false",
            "checkpoint.every_steps=0", "checkpoint.resume=never", "dist.device=cpu", "dist.strategy=fsdp",
            f"dist.pipeline_microbatches={args.microbatches}", f"run.dir={run_dir}"]


def run_variant(args, runtime, name: str, run_dir: Path) -> dict:
    """One `distrib train` run in these workers: tokens/s, the final training loss, and under pipeline parallel each
    pipeline rank's idle share (the mean over its data-parallel ranks) and plan's bubble share."""
    import contextlib
    import io

    import torch.distributed as dist

    from distrib.config import load_config
    from distrib.plan.pipeline import bubble_share
    from distrib.worker import train_on

    config = load_config(None, [*overrides(args, run_dir), *VARIANTS[name]])
    pipelined = config.dist.pipeline_parallel > 1
    clock = StageClock(args.skip)
    with contextlib.redirect_stderr(io.StringIO()):  # the runs' logs would bury the table
        summary = train_on(config, runtime, callbacks=(clock,) if pipelined else ())
    result = {"tokens_per_second": summary["tokens_per_second"], "final_loss": summary["train_loss"]}
    if pipelined:
        shares = [None] * runtime.world_size
        dist.all_gather_object(shares, clock.idle_share())
        pp = config.dist.pipeline_parallel
        per_rank = runtime.world_size // pp  # pp is the outermost dimension: ranks r * per_rank ... are rank r's
        result["idle_share"] = [statistics.fmean(shares[r * per_rank:(r + 1) * per_rank]) for r in range(pp)]
        result["bubble_share"] = bubble_share(pp, config.dist.pipeline_microbatches, config.dist.stages_per_rank)
    return result


def worker(args) -> None:
    """Every variant, --rounds times, forward in even rounds and backward in odd ones; rank 0 writes the results."""
    from distrib.config import DistConfig
    from distrib.distributed.runtime import open_runtime

    names, results = list(VARIANTS), {name: [] for name in VARIANTS}
    with open_runtime(DistConfig(device="cpu", timeout_s=900)) as runtime:
        for round_index in range(args.rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                # in the parent's folder: every rank of a sharded run writes into the one run.dir
                run_dir = Path(args.out).parent / f"{len(results[name])}-{name.replace(' ', '_').replace(',', '')}"
                results[name].append(run_variant(args, runtime, name, run_dir))
        if runtime.is_main:
            Path(args.out).write_text(json.dumps(results))


def summarise(results: dict) -> dict:
    """Each variant's median tokens/s; each pipeline variant's tokens/s over fsdp's, the median of the rounds' own
    ratios; its idle share per pipeline rank (the median over rounds) and plan's bubble share."""
    fsdp = results["fsdp 4"]
    out = {}
    for name, runs in results.items():
        row = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
               "final_loss": runs[-1]["final_loss"]}
        if name != "fsdp 4":
            row["ratio_to_fsdp"] = statistics.median(r["tokens_per_second"] / f["tokens_per_second"]
                                                     for r, f in zip(runs, fsdp))
            row["idle_share"] = [statistics.median(r["idle_share"][rank] for r in runs)
                                 for rank in range(len(runs[0]["idle_share"]))]
            row["bubble_share"] = runs[0]["bubble_share"]
        out[name] = row
    return out


def table(summary: dict, rounds: int) -> str:
    lines = [f"{'variant':<28} {'tokens/s':>9} {'/ fsdp 4':>9} {'idle rank 0':>12} {'idle rank 1':>12} "
             f"{'plan bubble':>12} {'final loss':>11}"]
    for name, row in summary.items():
        idle = row.get("idle_share", [])
        cells = [f"{share:12.3f}" for share in idle] or [f"{'':>12}", f"{'':>12}"]
        ratio = f"{row['ratio_to_fsdp']:9.3f}" if "ratio_to_fsdp" in row else f"{'':>9}"
        bubble = f"{row['bubble_share']:12.3f}" if "bubble_share" in row else f"{'':>12}"
        lines.append(f"{name:<28} {row['tokens_per_second']:9.0f} {ratio} {' '.join(cells)} {bubble} "
                     f"{row['final_loss']:11.4f}")
    lines.append(f"(medians of {rounds} round(s); / fsdp 4: the median of each round's own ratio)")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=4, help="first steps left out of the clocks")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch size (divisible by 4 x microbatches / 2)")
    parser.add_argument("--microbatches", type=int, default=4, help="dist.pipeline_microbatches")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _settings(args) -> list[str]:
    """The workers' arguments: the run's settings."""
    keys = ("steps", "skip", "rounds", "layers", "heads", "dim", "seq_len", "batch", "microbatches")
    return [item for key in keys for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = launch_workers(__file__, 4, _settings(args), args.timeout)
    summary = summarise(results)
    return report(args, results, summary, table(summary, args.rounds))


if __name__ == "__main__":
    sys.exit(main())
