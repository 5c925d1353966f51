"""The plan's peak against the dry run's on a matrix of layouts (issue 51): the 8B and 70B Llama shapes and a scaled
down DeepSeek-MoE-like GPT (8 blocks of dim 2048, 16 heads, 64 routed experts of width 1408, top 6, 2 shared experts),
each under fsdp, hsdp, tp 8 x fsdp, pp x tp x fsdp, cp 2 x fsdp, 2 replica groups or ep 8 x fsdp, with and without
activation checkpointing, on 128 nodes of 8 ranks with a CUDA target (the fused attention kernel in both). Each row is
one `distrib plan --dry-run --json` in a fresh process (the dry run counts blocks: distrib.plan.blocks); it prints the
plan's memory a rank needs, the dry run's (its measured peak + the prefetched block + the allocator's slack: the same
terms) and their ratio, which issue 51 asks within 15%.

    python scripts/bench_plan_matrix.py [--rows 8b-fsdp 70b-pp-tp ...] [--checkpointing off blocks] [--json OUT]
`--rows tiny` is the smallest work (a 2-wide Llama of 8 blocks under fsdp)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dry_run import LLAMA_8B, LLAMA_70B, TINY, dry_run_once_with  # noqa: E402

MOE = ("{n_layers=8, n_heads=16, dim=2048, n_experts=64, top_k=6, n_shared_experts=2, expert_hidden_dim=1408, "
       "tie_weights=false}")
LLAMA, GPT = "tests.helpers.pretrained:llama", ""
# name -> (model factory ("": the built-in GPT), model.kwargs, seq_len, global batch, settings)
ROWS = {"8b-fsdp": (LLAMA, LLAMA_8B, 4096, 1024, ["dist.strategy=fsdp"]),
        "8b-hsdp": (LLAMA, LLAMA_8B, 4096, 1024, ["dist.strategy=hsdp", "dist.shard_size=8"]),
        "8b-tp": (LLAMA, LLAMA_8B, 4096, 128, ["dist.strategy=fsdp", "dist.tensor_parallel=8"]),
        "8b-pp-tp": (LLAMA, LLAMA_8B, 4096, 128, ["dist.strategy=fsdp", "dist.pipeline_parallel=4",
                                                  "dist.tensor_parallel=8"]),
        "8b-cp": (LLAMA, LLAMA_8B, 8192, 512, ["dist.strategy=fsdp", "dist.context_parallel=2"]),
        "8b-groups": (LLAMA, LLAMA_8B, 4096, 1024, ["dist.strategy=fsdp", "dist.fault_tolerant_groups=2"]),
        "70b-tp": (LLAMA, LLAMA_70B, 8192, 128, ["dist.strategy=fsdp", "dist.tensor_parallel=8"]),
        "70b-pp-tp": (LLAMA, LLAMA_70B, 8192, 128, ["dist.strategy=fsdp", "dist.pipeline_parallel=8",
                                                    "dist.tensor_parallel=8"]),
        "moe-ep": (GPT, MOE, 4096, 1024, ["dist.strategy=fsdp", "dist.expert_parallel=8"]),
        "tiny": (LLAMA, TINY, 256, 1024, ["dist.strategy=fsdp"])}
WITHIN = 0.15


def row_settings(name: str, checkpointing: str) -> tuple[int, list[str]]:
    factory, kwargs, seq_len, global_batch, others = ROWS[name]
    model = [f"model.factory={factory}"] if factory else ["model.name=gpt"]
    return seq_len, [*model, f"model.kwargs={kwargs}", f"data.seq_len={seq_len}",
                     f"train.global_batch_size={global_batch}", "dist.device=cuda",
                     f"speed.activation_checkpointing={'blocks' if checkpointing == 'blocks' else 'none'}", *others]


def line(name: str, checkpointing: str, row: dict) -> str:
    if "error" in row:
        return f"{name:<10} {checkpointing:<7} failed: {row['error']}"
    plan, dry = row["memory_bytes_per_rank"], row["dry_run_memory_bytes_per_rank"]
    ratio = plan / dry
    return (f"{name:<10} {checkpointing:<7} {plan / 2**30:>9.2f} G {dry / 2**30:>9.2f} G {ratio:>6.3f} "
            f"{'yes' if abs(ratio - 1) <= WITHIN else 'NO':>6} {row['seconds']:>7.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=[name for name in ROWS if name != "tiny"])
    parser.add_argument("--checkpointing", nargs="+", choices=["off", "blocks"], default=["off", "blocks"])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        longest = max(ROWS[name][2] for name in args.rows)
        np.zeros(1100 * longest, dtype=np.uint16).tofile(root / "train.bin")  # one global batch of windows
        np.zeros(4 * longest, dtype=np.uint16).tofile(root / "val.bin")
        print(f"{'layout':<10} {'ckpt':<7} {'plan':>11} {'dry run':>11} {'ratio':>6} {'15%':>6} {'seconds':>7}",
              flush=True)
        for name in args.rows:
            for checkpointing in args.checkpointing:
                seq_len, sets = row_settings(name, checkpointing)
                row = dry_run_once_with(root, name, sets)
                rows.append({**row, "checkpointing": checkpointing})
                print(line(name, checkpointing, row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
