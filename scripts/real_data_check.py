"""Real Fashion-MNIST, default config: accuracy and wall-clock as 1 process and as N workers, in one table.

    python scripts/real_data_check.py [--nproc 2] [--set k=v ...]
Needs the data (apt-get install dataset-fashion-mnist, or data.root). Exits 1 if a target is missed:
>= 88% test accuracy in one process within 180 s, and N workers within 0.5 points of it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _train(run_dir: Path, nproc: int, overrides: list[str]) -> dict:
    launcher = [] if nproc == 1 else ["--nproc-per-node", str(nproc)]
    sets = [a for o in [f"run.dir={run_dir}", "run.progress=false", *overrides] for a in ("--set", o)]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "distrib", "train", *launcher, *sets], check=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {**summary, "wall_seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {n: _train(Path(tmp) / f"ws{n}", n, args.set) for n in (1, args.nproc)}
    print(f"\n{'workers':>7} {'test acc %':>10} {'test loss':>9} {'wall s':>7} {'samples/s':>9}")
    for n, s in rows.items():
        print(f"{n:>7} {100 * s['test_accuracy']:>10.2f} {s['test_loss']:>9.4f} {s['wall_seconds']:>7.1f} "
              f"{s['samples_per_second']:>9.0f}")
    one, many = rows[1], rows[args.nproc]
    ok = (one["test_accuracy"] >= 0.88 and one["wall_seconds"] < 180
          and abs(one["test_accuracy"] - many["test_accuracy"]) <= 0.005)
    print("targets met" if ok else "TARGETS MISSED: >= 88% in < 180 s, and N workers within 0.5 points")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
