"""Expert parallel at world size 4 on the CPU (gloo): the MoE GPT under ep 2 x fsdp 2 against fsdp 4 (the same model,
the same batches), and the dense GPT of the same active parameters under fsdp 4 (its hidden width top_k x the experts');
tokens/s of each and their ratios, paired round by round, and the share of ep's step its all-to-alls take.

    python scripts/bench_moe.py [--steps 12] [--skip 4] [--rounds 2] [--layers 4] [--dim 256] [--experts 8]
                                [--top-k 2] [--expert-hidden 256] [--seq-len 128] [--batch 16] [--json bench_moe.json]
One launch of 4 workers (torchrun) runs every variant in turn, --rounds times in alternating order (a shared machine's
load then meets each variant alike). All-to-all share: the wall time of expert parallel's all-to-alls (the counts',
the rows' there and back in forward, and the rows' in backward: from the gradient reaching an all-to-all's output to
it leaving its input), waits for the other ranks included, over the time of the same steps, both after --skip."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_launch import launch_workers, report  # scripts/ is on the path: this file's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # measure this checkout, whichever one is installed
# name -> the --set overrides on top of the common ones (fsdp at world size 4); "dense": the GPT without experts
VARIANTS = {"moe fsdp 4": [], "moe ep 2 x fsdp 2": ["dist.expert_parallel=2"], "dense fsdp 4": []}


class _Mark(torch.autograd.Function):
    """Identity; its backward tells the clock that the gradient passed here (before an all-to-all's backward: at its
    output; after it: at its input)."""

    @staticmethod
    def forward(ctx, x, clock, edge):
        ctx.clock, ctx.edge = clock, edge
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.backward_edge(ctx.edge)
        return grad, None, None


class AllToAllClock:
    """A distrib callback that times expert parallel's all-to-alls (distrib.distributed.expert_parallel's, wrapped for
    this run) and the steps; the steps after `skip` are kept."""

    def __init__(self, skip: int):
        self.skip, self.started, self.step_start = skip, None, None
        self.running = {"all_to_all": 0.0, "step": 0.0}
        self.kept = {"all_to_all": 0.0, "step": 0.0}

    def wrap(self, module) -> dict:
        """The module's collectives, timed; returns the originals (to put back)."""
        originals = {name: getattr(module, name) for name in ("all_to_all_single", "all_to_all_single_autograd")}

        def counts(*args, **kwargs):
            start = time.perf_counter()
            sent = originals["all_to_all_single"](*args, **kwargs)
            sent.wait()
            self.running["all_to_all"] += time.perf_counter() - start
            return sent

        def rows(x, *args):
            x = _Mark.apply(x, self, "input")
            start = time.perf_counter()
            out = originals["all_to_all_single_autograd"](x, *args)
            out = out.wait() if hasattr(out, "wait") else out
            self.running["all_to_all"] += time.perf_counter() - start
            return _Mark.apply(out, self, "output")

        module.all_to_all_single, module.all_to_all_single_autograd = counts, rows
        return originals

    def backward_edge(self, edge: str) -> None:
        if edge == "output":
            self.started = time.perf_counter()
        elif self.started is not None:
            self.running["all_to_all"] += time.perf_counter() - self.started
            self.started = None

    def on_train_start(self, model) -> None:
        self.step_start = time.perf_counter()

    def on_step_end(self, step: int, loss) -> None:
        now = time.perf_counter()
        self.running["step"] = now - self.step_start
        if step > self.skip:
            for key, seconds in self.running.items():
                self.kept[key] += seconds
        self.running, self.step_start = dict.fromkeys(self.running, 0.0), now

    def share(self) -> float:
        return self.kept["all_to_all"] / self.kept["step"]


def overrides(args, name: str, run_dir: Path) -> list[str]:
    from bench_gpt import docs_text

    if name.startswith("dense"):  # the same active parameters: one SwiGLU of top_k experts' width
        ffn = f"hidden_dim = {args.top_k * args.expert_hidden}"
    else:
        ffn = f"n_experts = {args.experts}, top_k = {args.top_k}, expert_hidden_dim = {args.expert_hidden}"
    kwargs = f"{{n_layers = {args.layers}, n_heads = {args.heads}, dim = {args.dim}, {ffn}}}"
    return ["model.name=gpt", f"model.kwargs={kwargs}", "data.name=text", f"data.root={docs_text()}",
            f"data.seq_len={args.seq_len}", "train.optimizer=adamw", "train.lr=1e-3", "train.weight_decay=0.0",
            "train.schedule=constant", "train.warmup_steps=0", f"train.global_batch_size={args.batch}",
            "train.epochs=0", f"train.max_steps={args.steps}", "train.eval_every_epochs=0",
            f"train.log_every={args.steps}", f"metrics.timing_skip_steps={args.skip}", "run.progress=false",
            "checkpoint.every_steps=0", "checkpoint.resume=never", "dist.device=cpu", "dist.strategy=fsdp",
            f"run.dir={run_dir}", *VARIANTS[name]]


def run_variant(args, runtime, name: str, run_dir: Path) -> dict:
    """One `distrib train` run in these workers: tokens/s, the final training loss, and under expert parallel the
    all-to-alls' share of the step (the mean over ranks)."""
    import contextlib
    import io

    import torch.distributed as dist

    from distrib.config import load_config
    from distrib.distributed import expert_parallel
    from distrib.worker import train_on

    config = load_config(None, overrides(args, name, run_dir))
    clock = AllToAllClock(args.skip)
    originals = clock.wrap(expert_parallel)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the runs' logs would bury the table
            summary = train_on(config, runtime, callbacks=(clock,))
    finally:
        for key, function in originals.items():
            setattr(expert_parallel, key, function)
    result = {"tokens_per_second": summary["tokens_per_second"], "final_loss": summary["train_loss"]}
    if config.dist.expert_parallel > 1:
        shares = [None] * runtime.world_size
        dist.all_gather_object(shares, clock.share())
        result["all_to_all_share"] = statistics.fmean(shares)
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
                run_dir = Path(args.out).parent / f"{len(results[name])}-{name.replace(' ', '_')}"
                results[name].append(run_variant(args, runtime, name, run_dir))
        if runtime.is_main:
            Path(args.out).write_text(json.dumps(results))


def summarise(results: dict) -> dict:
    """Each variant's median tokens/s; each one's ratio to the MoE under fsdp 4 (the median of the rounds' own
    ratios); ep's all-to-all share (the median over rounds)."""
    base = results["moe fsdp 4"]
    out = {}
    for name, runs in results.items():
        row = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
               "final_loss": runs[-1]["final_loss"],
               "ratio_to_moe_fsdp": statistics.median(r["tokens_per_second"] / b["tokens_per_second"]
                                                      for r, b in zip(runs, base))}
        if "all_to_all_share" in runs[0]:
            row["all_to_all_share"] = statistics.median(r["all_to_all_share"] for r in runs)
        out[name] = row
    return out


def table(summary: dict, rounds: int) -> str:
    lines = [f"{'variant':<20} {'tokens/s':>9} {'/ moe fsdp 4':>13} {'all-to-all':>11} {'final loss':>11}"]
    for name, row in summary.items():
        share = f"{row['all_to_all_share']:11.3f}" if "all_to_all_share" in row else f"{'':>11}"
        lines.append(f"{name:<20} {row['tokens_per_second']:9.0f} {row['ratio_to_moe_fsdp']:13.3f} {share} "
                     f"{row['final_loss']:11.4f}")
    lines.append(f"(medians of {rounds} round(s); / moe fsdp 4: the median of each round's own ratio; all-to-all: "
                 "its share of ep's step)")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=4, help="first steps left out of the clocks")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-hidden", type=int, default=256, help="each expert's hidden width")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch size (divisible by 4)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _settings(args) -> list[str]:
    """The workers' arguments: the run's settings."""
    keys = ("steps", "skip", "rounds", "layers", "heads", "dim", "experts", "top_k", "expert_hidden", "seq_len",
            "batch")
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
