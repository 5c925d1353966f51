"""A transformers Llama under distrib against the same model under loops written by hand, on the CPU (gloo): fsdp at
world size 2 against a bare FSDP2 loop, and pp 2 x fsdp 2 at world size 4 against a bare pipeline loop; tokens/s.

    python scripts/bench_hf.py [--rows fsdp,pp] [--steps 16] [--skip 4] [--rounds 3] [--batch 8] [--microbatches 2]
                               [--json bench_hf.json]
The model: LlamaForCausalLM from its config (--hidden 256, --layers 4, 4 heads, 2 key-value heads, MLP 688, vocab
512; random weights, nothing downloaded), trained on byte windows of --seq-len of the repository's docs (data.name =
text, the windows scripts/bench_gpt.py's loop reads too) with AdamW. One launch (torchrun) per row runs distrib
(worker.train_on, what `distrib train` runs in each worker) and the hand loop alternately, --rounds times each; each
run's tokens/s counts the steps after --skip (metrics.timing_skip_steps, the same clock for the hand loop); a row's
ratio is the median of the rounds' own distrib / hand ratios, also on rank 0's CPU clock per step (thread_time),
which other processes on a shared machine hardly move. The Llama initialises itself (reset_parameters), as each rank
then fills its own shards; --plain-init: transformers' class as is, whose weights distrib sends from rank 0.
- fsdp: `dist.strategy = fsdp` against fully_shard on each decoder layer, then the root, AdamW (foreach).
- pp: `dist.pipeline_parallel = 2` (1f1b) under fsdp against the model split by hand into two PipelineStages
  (embeddings + the first half of the layers; the rest + norm + lm_head; rotary position embeddings from the
  positions in each stage; attention_mask None), Schedule1F1B, each stage fully_shard over its 2 data ranks."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_launch import report  # scripts/ is on the path: this file's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # measure this checkout, whichever one is installed
LR = 1e-3
ROWS = {"fsdp": 2, "pp": 4}  # row -> its world size
TARGET = 0.95


def llama(hidden: int = 256, layers: int = 4, seq_len: int = 128, own_init: bool = True):
    """`model.factory = bench_hf:llama`: the benchmark's Llama from its config, random weights. own_init: a subclass
    whose reset_parameters is transformers' own _init_weights on each module, so that each rank fills its own shards
    (the hand loops build it whole, seeded as distrib seeds: the same weights); False: transformers' class as is,
    which distrib builds whole on rank 0 and sends each rank its shards (not yet under pipeline parallel)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=688 * hidden // 256,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=seq_len, tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    if own_init:
        model.__class__ = _self_initialising(LlamaForCausalLM)
    return model


_SUBCLASSES: dict[type, type] = {}


def _self_initialising(base: type) -> type:
    def reset_parameters(self) -> None:
        for module in self.modules():
            self._init_weights(module)

    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = type(base.__name__, (base,), {"__module__": __name__,
                                                          "reset_parameters": reset_parameters})
    return _SUBCLASSES[base]


def _model_kwargs(args) -> dict:
    return {"hidden": args.hidden, "layers": args.layers, "seq_len": args.seq_len, "own_init": not args.plain_init}


def overrides(args, row: str, run_dir: Path) -> list[str]:
    from bench_gpt import docs_text

    kwargs = ", ".join(f"{key} = {json.dumps(value)}" for key, value in _model_kwargs(args).items())  # TOML
    pp = ["dist.pipeline_parallel=2", "dist.pipeline_schedule=1f1b",
          f"dist.pipeline_microbatches={args.microbatches}"] if row == "pp" else []
    return ["model.factory=bench_hf:llama", f"model.kwargs={{{kwargs}}}", "data.name=text", f"data.root={docs_text()}",
            f"data.seq_len={args.seq_len}", "train.optimizer=adamw", f"train.lr={LR}", "train.weight_decay=0.0",
            "train.schedule=constant", "train.warmup_steps=0", "train.seed=0", "train.precision=fp32",
            f"train.global_batch_size={args.batch}", "train.epochs=0", f"train.max_steps={args.steps}",
            "train.eval_every_epochs=0", f"train.log_every={args.steps}", f"metrics.timing_skip_steps={args.skip}",
            "run.progress=false", "checkpoint.every_steps=0", "checkpoint.resume=never", "dist.device=cpu",
            "dist.strategy=fsdp", f"run.dir={run_dir}", *pp, *args.set]


def _cpu_rate(args, cpu_steps: list[float]) -> float:
    """tokens/s on this thread's CPU clock, which other processes on a shared machine hardly move (it leaves out
    gloo's threads and the waits for other ranks), over the steps after --skip."""
    timed = cpu_steps[args.skip:]
    return len(timed) * args.batch * args.seq_len / sum(timed)


def distrib_run(args, runtime, row: str, run_dir: Path) -> dict:
    """One `distrib train` run in these workers (worker.train_on): its tokens/s (its own meter's, and on the CPU
    clock read at each end-of-step mark) and final training loss."""
    from distrib.config import load_config
    from distrib.worker import train_on

    config = load_config(None, overrides(args, row, run_dir))
    log, cpu_ends = io.StringIO(), []
    try:
        with contextlib.redirect_stderr(log):  # the runs' logs would bury the table
            summary = train_on(config, runtime, on_step_end=lambda step: cpu_ends.append(time.thread_time()))
    except BaseException:
        sys.stderr.write(log.getvalue())
        raise
    # the marks time steps 2, 3, ...: the first is in the warm-up that --skip (at least 1) leaves out
    cpu_steps = [float("nan"), *(b - a for a, b in zip(cpu_ends, cpu_ends[1:]))]
    return {"tokens_per_second": summary["tokens_per_second"], "cpu_tokens_per_second": _cpu_rate(args, cpu_steps),
            "final_loss": summary["train_loss"]}


class Windows:
    """The trainer's byte windows for one data-parallel rank (bench_gpt's loop reads them: the batch plan's sample
    order, each sample's hashed start), so the hand loops take the same steps on the same data."""

    def __init__(self, args, batch_rank: int, data_ranks: int):
        from bench_gpt import GptHandLoop, byte_stream

        from distrib.data import BatchPlan

        self.reader = GptHandLoop.__new__(GptHandLoop)  # its batch() alone: no model, no optimizer
        self.reader.stream = byte_stream(argparse.Namespace(text=_text(), seq_len=args.seq_len), None)
        self.reader.seq_len, self.reader.order = args.seq_len, None
        samples = (len(self.reader.stream) - 1) // args.seq_len
        self.reader.plan = BatchPlan(samples, args.batch, 1, batch_rank, data_ranks, 0)

    def __call__(self, step: int):
        return self.reader.batch(step)


def _text() -> str:
    from bench_gpt import docs_text

    return str(docs_text())


class HandFsdp:
    """FSDP2 by hand: fully_shard on each decoder layer, then on the root, over all ranks; AdamW (foreach); the
    model's logits, cross-entropy over every position."""

    def __init__(self, args, runtime):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from distrib.distributed.strategies.materialise import build_whole

        model = build_whole(lambda: llama(**_model_kwargs(args)), seed=0)
        mesh = init_device_mesh("cpu", (runtime.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.0, foreach=True)
        self.windows, self.loss = Windows(args, runtime.rank, runtime.world_size), None

    def step(self, step: int) -> None:
        import torch.nn.functional as F

        x, y = self.windows(step)
        logits = self.model(x).logits
        self.loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.optimizer.zero_grad(set_to_none=True)
        self.loss.backward()
        self.optimizer.step()

    def final_loss(self) -> float:
        """The last global batch's mean loss (a collective of every rank)."""
        import torch.distributed as dist

        final = self.loss.detach().clone()
        dist.all_reduce(final)
        return final.item() / dist.get_world_size()


def _stage_class():
    import torch
    import torch.nn as nn

    class Stage(nn.Module):
        """Part of the Llama by hand: its embeddings (the first stage), some decoder layers, its norm and head (the
        last); the rotary position embeddings from the positions, in each stage; no mask (SDPA's causal attention)."""

        def __init__(self, model, layers: slice, first: bool, last: bool):
            super().__init__()
            base = model.model
            self.embed_tokens = base.embed_tokens if first else None
            self.layers = nn.ModuleList(base.layers[layers])
            self.rotary_emb = base.rotary_emb
            self.norm, self.lm_head = (base.norm, model.lm_head) if last else (None, None)

        def forward(self, x):
            hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            position_embeddings = self.rotary_emb(hidden, position_ids)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                               position_embeddings=position_embeddings)
            return self.lm_head(self.norm(hidden)) if self.lm_head is not None else hidden

    return Stage


def _token_loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class HandPipeline:
    """A pipeline by hand at pp 2 x fsdp 2: the Llama cut in two Stages, this rank's one fully_shard over its data
    ranks (each decoder layer, then the stage), torch's PipelineStage and Schedule1F1B, AdamW (foreach)."""

    def __init__(self, args, runtime):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from distrib.distributed.strategies.materialise import build_whole

        mesh = init_device_mesh("cpu", (2, runtime.world_size // 2), mesh_dim_names=("pp", "dp"))
        index, data_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        model = build_whole(lambda: llama(**_model_kwargs(args)), seed=0)
        half = args.layers // 2
        stage = _stage_class()(model, slice(0, half) if index == 0 else slice(half, None), index == 0, index == 1)
        for layer in stage.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
        self.first, self.losses = index == 0, []
        self.schedule = Schedule1F1B(PipelineStage(stage, index, 2, torch.device("cpu"), group=mesh["pp"].get_group()),
                                     n_microbatches=args.microbatches, loss_fn=_token_loss)
        self.optimizer = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=0.0, foreach=True)
        self.windows = Windows(args, data_rank, runtime.world_size // 2)

    def step(self, step: int) -> None:
        x, y = self.windows(step)
        self.optimizer.zero_grad(set_to_none=True)
        self.losses = []
        if self.first:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=self.losses)
        self.optimizer.step()

    def final_loss(self) -> float:
        """The last global batch's mean loss: the last stage's microbatch means, over its data ranks."""
        import torch
        import torch.distributed as dist

        final = torch.stack(self.losses).mean().detach() if self.losses else torch.zeros(())
        dist.all_reduce(final)
        return final.item() / (dist.get_world_size() // 2)


def hand_run(args, runtime, row: str) -> dict:
    """The hand loop of the row, --steps steps; tokens/s over the steps after --skip, as distrib's meter counts (a
    step from the end of the one before: its data included)."""
    hand = (HandFsdp if row == "fsdp" else HandPipeline)(args, runtime)
    ends, cpu_ends = [time.perf_counter()], [time.thread_time()]
    for step in range(args.steps):
        hand.step(step)
        ends.append(time.perf_counter())
        cpu_ends.append(time.thread_time())
    steps = [b - a for a, b in zip(ends, ends[1:])][args.skip:]
    return {"tokens_per_second": len(steps) * args.batch * args.seq_len / sum(steps),
            "cpu_tokens_per_second": _cpu_rate(args, [b - a for a, b in zip(cpu_ends, cpu_ends[1:])]),
            "final_loss": hand.final_loss()}


def worker(args) -> None:
    """distrib and the hand loop alternately, --rounds times (distrib first in even rounds); rank 0 writes them."""
    import torch
    import torch.distributed as dist

    from distrib.config import DistConfig
    from distrib.distributed.runtime import open_runtime

    torch.set_num_threads(1)  # 2 or 4 workers on a few cores: more threads only wait on each other
    results = {"distrib": [], "hand": []}
    with open_runtime(DistConfig(device="cpu", timeout_s=900)) as runtime:
        for round_index in range(args.rounds):
            for name in ("distrib", "hand") if round_index % 2 == 0 else ("hand", "distrib"):
                dist.barrier()  # every rank starts each run together
                if name == "hand":
                    results[name].append(hand_run(args, runtime, args.row))
                else:  # in the parent's folder: every rank of a sharded run writes into the one run.dir
                    run_dir = Path(args.out).parent / f"{args.row}-{round_index}"
                    results[name].append(distrib_run(args, runtime, args.row, run_dir))
        if runtime.is_main:
            Path(args.out).write_text(json.dumps(results))


def summarise(results: dict[str, dict]) -> dict:
    """Per row: each loop's median tokens/s and runs, and distrib / hand (the median of the rounds' own ratios, and
    their spread)."""
    out = {}
    for row, runs in results.items():
        ratios, cpu_ratios = ([d[key] / h[key] for d, h in zip(runs["distrib"], runs["hand"])]
                              for key in ("tokens_per_second", "cpu_tokens_per_second"))
        out[row] = {**{name: {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in by),
                              "cpu_tokens_per_second": statistics.median(r["cpu_tokens_per_second"] for r in by),
                              "runs": [r["tokens_per_second"] for r in by], "final_loss": by[-1]["final_loss"]}
                       for name, by in runs.items()},
                    "ratio": statistics.median(ratios), "ratios": ratios, "met": statistics.median(ratios) >= TARGET,
                    "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratios": cpu_ratios}
    return out


def table(summary: dict, rounds: int) -> str:
    names = {"fsdp": "fsdp 2 (world 2)", "pp": "pp 2 x fsdp 2 (world 4)"}
    lines = [f"{'row':<24} {'distrib tok/s':>13} {'hand tok/s':>11} {'distrib/hand':>13} {'rounds':>20} "
             f"{'cpu clock':>10} {'rounds':>20} {'loss distrib':>12} {'loss hand':>10}"]
    for row, s in summary.items():
        spread, cpu_spread = (" ".join(f"{r:.3f}" for r in s[key]) for key in ("ratios", "cpu_ratios"))
        distrib, hand = s["distrib"], s["hand"]
        lines.append(f"{names[row]:<24} {distrib['tokens_per_second']:13.0f} {hand['tokens_per_second']:11.0f} "
                     f"{s['ratio']:13.3f} {spread:>20} {s['cpu_ratio']:10.3f} {cpu_spread:>20} "
                     f"{distrib['final_loss']:12.4f} {hand['final_loss']:10.4f}")
    lines.append(f"(medians of {rounds} alternating rounds; distrib/hand: the median of each round's own ratio on the "
                 f"wall clock, the rounds' ratios beside it; cpu clock: the same on rank 0's CPU time per step; "
                 f"target >= {TARGET})")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="fsdp,pp", help="fsdp (world size 2), pp (world size 4), or both")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=4, help="first steps left out of the clocks (at least 1)")
    parser.add_argument("--rounds", type=int, default=3, help="distrib and hand runs each, alternating")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (even: half in each stage)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch size")
    parser.add_argument("--microbatches", type=int, default=2, help="pp: dist.pipeline_microbatches")
    parser.add_argument("--plain-init", action="store_true",
                        help="transformers' class as is (distrib builds its weights on rank 0), not self-initialising")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per row before it is killed")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="one more distrib override for distrib's runs (what a step of distrib costs, key by key)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _settings(args) -> list[str]:
    """The workers' arguments: the run's settings."""
    keys = ("steps", "skip", "rounds", "hidden", "layers", "seq_len", "batch", "microbatches")
    plain = ["--plain-init"] if args.plain_init else []
    plain += [item for value in args.set for item in ("--set", value)]
    return [*plain, *(item for key in keys for item in (f"--{key.replace('_', '-')}", str(getattr(args, key))))]


def launch(args, row: str, tmp: Path) -> dict:
    """One torchrun launch of the row's world size running worker(); its results."""
    out = tmp / row / "results.json"
    out.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "scripts"),
                                                        os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ROWS[row]}", __file__,
           "--worker", "--row", row, "--out", str(out), *_settings(args)]
    done = subprocess.run(cmd, env=env, timeout=args.timeout)
    if done.returncode or not out.exists():
        sys.exit(f"bench_hf: the {row} workers failed (exit code {done.returncode}; see the errors above)")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.skip < 1 or args.steps <= args.skip:
        sys.exit(f"bench_hf: --skip {args.skip} --steps {args.steps}: skip at least 1 step and fewer than --steps")
    if args.worker:
        worker(args)
        return 0
    rows = args.rows.split(",")
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        sys.exit(f"bench_hf: --rows {args.rows!r}: {', '.join(unknown)} is no row; use fsdp, pp or fsdp,pp")
    with tempfile.TemporaryDirectory() as tmp:
        results = {row: launch(args, row, Path(tmp)) for row in rows}
    summary = summarise(results)
    return report(args, results, summary, table(summary, args.rounds))


if __name__ == "__main__":
    sys.exit(main())
