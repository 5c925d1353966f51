"""How long `distrib plan --dry-run`'s dry run takes, and its peak resident memory, for an 8B Llama (transformers'
LlamaForCausalLM, built on meta through model.factory) on 1,024 ranks under fsdp, 128 x 8 hsdp and pp 4 x tp 8 x
fsdp 32, each in a fresh process, against the targets of 60 s and 2 GiB each (issue 36).

    python scripts/bench_dry_run.py [--layouts fsdp hsdp 3d] [--seq-len 2048] [--json OUT]
Writes tiny train.bin / val.bin token files to a temporary folder (the dry run reads the data as train would)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TARGET_SECONDS, TARGET_RSS = 60.0, 2 * 2**30
LLAMA_8B = ("{vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, "
            "num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192}")
# name -> (dist.* settings, global batch): one sample a rank per microbatch
LAYOUTS = {"fsdp": (["dist.strategy=fsdp"], 1024),
           "hsdp": (["dist.strategy=hsdp", "dist.shard_size=8"], 1024),
           "3d": (["dist.strategy=fsdp", "dist.pipeline_parallel=4", "dist.tensor_parallel=8"], 32 * 4)}
# The dry run in a child process (a fresh heap, as a user runs it): its figures, then its peak RSS (KiB) and seconds.
CHILD = ("import json, resource, sys, time; from distrib.config import load_config; from distrib.plan import Machine; "
         "from distrib.plan.dry_run import dry_run; start = time.perf_counter(); "
         "figures = dry_run(load_config(None, sys.argv[1:]), Machine(128, 8)); "
         "print(json.dumps({**figures, 'seconds': time.perf_counter() - start, "
         "'peak_rss_bytes': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")


def dry_run_once(root: Path, layout: str, seq_len: int) -> dict:
    dist_sets, global_batch = LAYOUTS[layout]
    sets = ["data.name=tokens", f"data.root={root}", "data.vocab_size=50304", f"data.seq_len={seq_len}",
            "model.factory=tests.helpers.pretrained:llama", f"model.kwargs={LLAMA_8B}", "train.precision=bf16",
            "train.optimizer=adamw", f"train.global_batch_size={global_batch}", "dist.device=cpu", *dist_sets]
    done = subprocess.run([sys.executable, "-c", CHILD, *sets], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        return {"layout": layout, "error": done.stderr.strip().splitlines()[-1]}
    return {"layout": layout, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        np.zeros(1100 * args.seq_len, dtype=np.uint16).tofile(root / "train.bin")  # one global batch of windows
        np.zeros(4 * args.seq_len, dtype=np.uint16).tofile(root / "val.bin")
        print(f"{'layout':<8} {'seconds':>8} {'peak RSS':>10} {'rank peak':>10}  within 60 s and 2 GiB")
        for layout in args.layouts:
            row = dry_run_once(root, layout, args.seq_len)
            rows.append(row)
            if "error" in row:
                print(f"{layout:<8} failed: {row['error']}")
                continue
            ok = row["seconds"] < TARGET_SECONDS and row["peak_rss_bytes"] < TARGET_RSS
            print(f"{layout:<8} {row['seconds']:>8.1f} {row['peak_rss_bytes'] / 2**30:>8.2f} G "
                  f"{row['dry_run_peak_bytes_per_rank'] / 2**30:>8.2f} G  {'yes' if ok else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
