"""Several training runs one after another in one set of torchrun workers, for tests that compare runs at world size
2 without the launch being their point: the workers' start-up (imports: most of a short run's cost) is paid once.

    torchrun --nproc-per-node 2 tests/helpers/train_runs.py RUNS_JSON

RUNS_JSON: a list of runs, each a list of section.key=value items, trained by run_training (what `distrib train`'s
workers call), in order; before run i every rank says `=== run i (rank r)` on stdout and stderr, so that
split_runs() can hand each run's own output to a test."""

from __future__ import annotations

import json
import subprocess
import sys

MARK = "=== run {index} (rank {rank})"


def torchrun_runs(nproc: int, runs: list[list[str]], timeout: float | None = None,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The runs in one `torchrun --standalone` launch of nproc workers (through the tests' one runner)."""
    from tests.helpers.processes import EVENT_S, REPO, run

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           json.dumps([[str(item) for item in items] for items in runs])]
    # PYTHONPATH: the script is run as a file, which sees the repository's tests.* only through it.
    return run(cmd, timeout or EVENT_S, env={"PYTHONPATH": str(REPO), **(env or {})})


def split_runs(text: str, count: int) -> list[str]:
    """Each run's part of one stream: from the first rank's mark of run i to the first rank's mark of run i + 1 (the
    process group's closing barrier ends run i on every rank before any rank starts run i + 1)."""
    starts = [text.index(f"=== run {index} (") for index in range(count)]
    return [text[start:end] for start, end in zip(starts, [*starts[1:], len(text)])]


def main(runs: list[list[str]]) -> None:
    import os

    from distrib.config import load_config
    from distrib.worker import run_training

    for index, items in enumerate(runs):
        mark = MARK.format(index=index, rank=os.environ.get("RANK", "0"))
        print(mark, flush=True)
        print(mark, file=sys.stderr, flush=True)
        run_training(load_config(None, items))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
