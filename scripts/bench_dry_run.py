"""How long `distrib plan --dry-run` takes (the plan, the dry run and its verdict), and its peak resident memory, each
layout in a fresh process: an 8B Llama (transformers' LlamaForCausalLM, built on meta through model.factory) on 1,024
ranks under fsdp, 128 x 8 hsdp and pp 4 x tp 8 x fsdp 32 against 60 s and 2 GiB (issue 36); the Llama-3-70B shape
(hidden 8192, 80 layers, 64 heads, 8 KV heads, ffn 28672, seq 8192, global batch 128, AdamW, bf16, activation
checkpointing, a CUDA target) at pp 8 x tp 8 x fsdp 16 against 90 s and 2 GiB, where it must fit 80 GiB (issue 51);
`tiny`, a 2-block-wide Llama of 8 layers, the smallest work. With --compare each is run again with --every-block (every
block stepped, not 2 and 3 a stage counted for the rest) and the ratio of the two peaks printed.

    python scripts/bench_dry_run.py [--layouts fsdp hsdp 3d 70b tiny] [--seq-len 2048] [--compare] [--json OUT]
Writes zero train.bin / val.bin token files to a temporary folder (the dry run reads the data as train would)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TARGET_RSS = 2 * 2**30
LLAMA = ("{{vocab_size={vocab}, hidden_size={hidden}, intermediate_size={ffn}, num_hidden_layers={layers}, "
         "num_attention_heads={heads}, num_key_value_heads=8, max_position_embeddings=8192}}")
LLAMA_8B = LLAMA.format(vocab=128256, hidden=4096, ffn=14336, layers=32, heads=32)
LLAMA_70B = LLAMA.format(vocab=128256, hidden=8192, ffn=28672, layers=80, heads=64)
TINY = LLAMA.format(vocab=256, hidden=64, ffn=128, layers=8, heads=8)
# name -> (model.kwargs, seq_len (None: --seq-len), global batch, other settings, target seconds)
LAYOUTS = {"fsdp": (LLAMA_8B, None, 1024, ["dist.strategy=fsdp", "dist.device=cpu"], 60.0),
           "hsdp": (LLAMA_8B, None, 1024, ["dist.strategy=hsdp", "dist.shard_size=8", "dist.device=cpu"], 60.0),
           "3d": (LLAMA_8B, None, 32 * 4, ["dist.strategy=fsdp", "dist.pipeline_parallel=4",
                                           "dist.tensor_parallel=8", "dist.device=cpu"], 60.0),
           "70b": (LLAMA_70B, 8192, 128, ["dist.strategy=fsdp", "dist.pipeline_parallel=8", "dist.tensor_parallel=8",
                                          "dist.device=cuda", "speed.activation_checkpointing=blocks"], 90.0),
           "tiny": (TINY, 256, 1024, ["dist.strategy=fsdp", "dist.device=cuda"], 60.0)}
# `distrib plan --dry-run --json` in a child process (a fresh heap, as a user runs it): its figures, then its peak RSS
# on the last line. Its seconds are the child's, start-up and imports included.
CHILD = ("import json, resource, sys; from distrib.cli import main; code = main(sys.argv[1:]); "
         "print(json.dumps({'code': code, "
         "'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")


def dry_run_once(root: Path, layout: str, seq_len: int, every_block: bool) -> dict:
    kwargs, own_seq_len, global_batch, others, _ = LAYOUTS[layout]
    sets = [f"data.seq_len={own_seq_len or seq_len}", "model.factory=tests.helpers.pretrained:llama",
            f"model.kwargs={kwargs}", f"train.global_batch_size={global_batch}", *others]
    return dry_run_once_with(root, layout, sets, every_block)


def dry_run_once_with(root: Path, layout: str, settings: list[str], every_block: bool = False) -> dict:
    """`distrib plan --dry-run --json` on 128 x 8 ranks of bf16 AdamW over the token files in root, with `settings`
    (dotted overrides: the model, the sequence, the batch, the layout), in a child process: its JSON, its peak RSS and
    its seconds, or {"error": its last line}."""
    sets = ["data.name=tokens", f"data.root={root}", "data.vocab_size=50304", "train.precision=bf16",
            "train.optimizer=adamw", *settings]
    args = ["plan", *[a for s in sets for a in ("--set", s)], "--nnodes", "128", "--nproc-per-node", "8",
            "--dry-run", "--json", *(["--every-block"] if every_block else [])]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds, lines = time.perf_counter() - start, done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"layout": layout, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return {"layout": layout, **json.loads("\n".join(lines[:-1])), **json.loads(lines[-1]), "seconds": seconds}


def _row(row: dict, whole: dict | None) -> str:
    layout = row["layout"]
    if "error" in row:
        return f"{layout:<6} failed: {row['error']}"
    ok = row["seconds"] < LAYOUTS[layout][4] and row["peak_rss_bytes"] < TARGET_RSS
    verdict = f"{'fits' if row['dry_run_fits'] else 'NO FIT'} {row['dry_run_memory_bytes_per_rank'] / 2**30:7.2f} G"
    line = (f"{layout:<6} {row['seconds']:>8.1f} {row['peak_rss_bytes'] / 2**30:>8.2f} G "
            f"{row['dry_run_peak_bytes_per_rank'] / 2**30:>9.2f} G  {verdict:>16}  {'yes' if ok else 'NO':>6}")
    if whole is not None:
        line += (f"  {whole['seconds']:>8.1f} {whole['dry_run_peak_bytes_per_rank'] / 2**30:>9.2f} G "
                 f"{row['dry_run_peak_bytes_per_rank'] / whole['dry_run_peak_bytes_per_rank']:>6.3f}"
                 if "error" not in whole else f"  failed: {whole['error']}")
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["fsdp", "hsdp", "3d", "70b"])
    parser.add_argument("--seq-len", type=int, default=2048, help="the 8B layouts' data.seq_len")
    parser.add_argument("--compare", action="store_true", help="also step every block: the counted peak's ratio")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        longest = max([args.seq_len, *(LAYOUTS[name][1] or 0 for name in args.layouts)])
        np.zeros(1100 * longest, dtype=np.uint16).tofile(root / "train.bin")  # one global batch of windows
        np.zeros(4 * longest, dtype=np.uint16).tofile(root / "val.bin")
        print(f"{'layout':<6} {'seconds':>8} {'peak RSS':>10} {'rank peak':>11}  {'verdict':>16}  {'target':>6}"
              + (f"  {'every block: s':>8} {'rank peak':>11} {'ratio':>6}" if args.compare else ""), flush=True)
        for layout in args.layouts:
            row = dry_run_once(root, layout, args.seq_len, every_block=False)
            whole = dry_run_once(root, layout, args.seq_len, every_block=True) if args.compare else None
            rows.append({**row, **({"every_block": whole} if whole else {})})
            print(_row(row, whole), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in row and "error" not in row.get("every_block", {}) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
