"""A LoRA fine-tune of a Hugging Face Llama (peft, r 8 on q_proj and v_proj, base weights from a local safetensors
folder) by `distrib train` against a plain torchrun loop a user writes by hand for the same job (from_pretrained,
get_peft_model, fully_shard per decoder layer, AdamW over the adapter, batches of the same shape, the same steps), on
the CPU (gloo).

    python scripts/bench_lora.py [--world-size 2] [--steps 12] [--rounds 2] [--layers 4] [--dim 256] [--json F]

Each run is timed from outside, as a user times it: from the command's start to its first step's log line and to its
exit; rounds alternate the order. Printed: the medians and distrib / hand for both, and distrib's own start-up line
(its parts: imports and process group, data, model, checks, state). Targets: none yet; this is the row issue 33
asked for, so that start-up regressions show."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN, VOCAB, SAMPLES = 64, 2048, 4096


def llama_config(layers: int, dim: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=dim, intermediate_size=dim * 8 // 3, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ_LEN)


def lora(model, r: int = 8):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"]))


def lora_llama(layers: int, dim: int):
    """distrib's factory: the architecture from its config; model.init_from fills the base."""
    from transformers import LlamaForCausalLM

    return lora(LlamaForCausalLM(llama_config(layers, dim)))


class TokenDicts(torch.utils.data.Dataset):
    """input_ids windows as Hugging Face dict samples (labels = input_ids: the model shifts them)."""

    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        ids = self.ids[index]
        return {"input_ids": ids, "attention_mask": ids * 0 + 1, "labels": ids.clone()}


def token_dicts():
    ids = torch.randint(0, VOCAB, (SAMPLES + 64, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return TokenDicts(ids[:SAMPLES]), TokenDicts(ids[SAMPLES:])


def hand_loop(base: str, steps: int, batch: int, layers: int, dim: int) -> None:
    """What a user writes under torchrun: the same model, data order (the global batch's slice per rank), AdamW."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = lora(LlamaForCausalLM.from_pretrained(base))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    train, _ = token_dicts()
    per_rank = batch // world
    for step in range(steps):
        rows = train.ids[step * batch + rank * per_rank:step * batch + (rank + 1) * per_rank]
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


def _timed(cmd: list[str], env: dict) -> dict:
    """Seconds from the start to the first `step 1` line on stderr, and to the exit; distrib's start-up line."""
    start, first, startup, said = time.perf_counter(), None, "", []
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        said = [*said[-20:], line]
        if first is None and "step 1 " in line:
            first = time.perf_counter() - start
        if "start-up" in line:
            startup = line.strip()
    if proc.wait(timeout=1800) != 0 or first is None:
        sys.exit(f"bench_lora: {' '.join(cmd)} failed (exit {proc.returncode}):\n{''.join(said)}")
    return {"first_step_s": first, "total_s": time.perf_counter() - start, "startup_line": startup}


def _commands(args, base: Path, run_dir: Path) -> dict[str, list[str]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}"]
    sets = ["model.factory=bench_lora:lora_llama", f"model.kwargs={{layers = {args.layers}, dim = {args.dim}}}",
            f"model.init_from={base}", "data.factory=bench_lora:token_dicts", "dist.strategy=fsdp",
            "dist.device=cpu", f"train.max_steps={args.steps}", "train.epochs=0", "train.optimizer=adamw",
            "train.lr=1e-3", "train.weight_decay=0", "train.warmup_steps=0", "train.schedule=constant",
            f"train.global_batch_size={args.batch}", "train.log_every=1", "train.eval_every_epochs=0",
            "checkpoint.every_steps=0", "run.progress=false", f"run.dir={run_dir}"]
    return {"distrib": [sys.executable, "-m", "distrib", "train", f"--nproc-per-node={args.world_size}",
                        *[arg for item in sets for arg in ("--set", item)]],
            "hand": [*torchrun, __file__, "--hand", str(base), "--steps", str(args.steps), "--batch",
                     str(args.batch), "--layers", str(args.layers), "--dim", str(args.dim)]}


def bench(args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "scripts"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    times: dict[str, list[dict]] = {"distrib": [], "hand": []}
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        base = Path(tmp) / "base"
        LlamaForCausalLM(llama_config(args.layers, args.dim)).save_pretrained(base)
        for round_ in range(args.rounds):
            names = ["distrib", "hand"] if round_ % 2 == 0 else ["hand", "distrib"]
            for name in names:
                commands = _commands(args, base, Path(tmp) / f"run_{round_}")
                times[name].append(_timed(commands[name], env))
    medians = {name: {key: statistics.median(run[key] for run in runs) for key in ("first_step_s", "total_s")}
               for name, runs in times.items()}
    ratios = {key: medians["distrib"][key] / medians["hand"][key] for key in ("first_step_s", "total_s")}
    return {"medians": medians, "ratios": ratios, "startup_line": times["distrib"][-1]["startup_line"],
            "world_size": args.world_size, "steps": args.steps, "load_average": os.getloadavg()[0]}


def table(result: dict) -> str:
    rows = [f"LoRA r 8 on a Llama, fsdp at world size {result['world_size']}, {result['steps']} steps "
            f"(load average {result['load_average']:.1f})",
            f"{'':>8} {'to first step s':>16} {'to the end s':>13}"]
    for name, figures in result["medians"].items():
        rows.append(f"{name:>8} {figures['first_step_s']:16.1f} {figures['total_s']:13.1f}")
    ratios = result["ratios"]
    rows.append(f"{'ratio':>8} {ratios['first_step_s']:16.2f} {ratios['total_s']:13.2f}   (distrib / hand)")
    return "\n".join(rows + [f"distrib's {result['startup_line'].removeprefix('[distrib] ')}"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--hand", metavar="BASE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.hand:
        hand_loop(args.hand, args.steps, args.batch, args.layers, args.dim)
        return 0
    result = bench(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
