"""What the benches that launch their own workers share: one torchrun launch of this script's --worker mode, whose
results come back as JSON, and the report (the table, and the whole record with --json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def launch_workers(script: str, nproc: int, settings: list[str], timeout: float) -> dict:
    """Runs `script --worker --out FILE *settings` in nproc workers (torchrun, this machine) and returns what rank 0
    wrote to FILE; exits with one line if the workers failed (their errors are above it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "scripts"),
                                                            os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
               "--worker", "--out", str(out), *settings]
        done = subprocess.run(cmd, env=env, timeout=timeout)
        if done.returncode or not out.exists():
            sys.exit(f"{Path(script).stem}: the workers failed (exit code {done.returncode}; see the errors above)")
        return json.loads(out.read_text())


def report(args, results: dict, summary: dict, table: str) -> int:
    """Prints the table; with --json also writes the settings, every run and the summary there."""
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "runs": results, "summary": summary}, indent=1))
        print(f"written to {args.json}")
    return 0
