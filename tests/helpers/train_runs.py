"""Several `distrib train` runs in one launch of workers (torchrun or `distrib launch`), so that they share its
process start-up: each run as a launched worker of `distrib train` runs it (distrib.cli.main, which opens and closes
its own process group), with environment variables of its own.

    python tests/helpers/train_runs.py RUNS.json     RUNS.json: [[NAME, {"VAR": "VALUE"}, ["section.key=value", ...]]]

Ends with the first non-zero exit code of a run. Restarted by `distrib launch --max-restarts`, it runs them again:
a finished run then trains nothing, the interrupted one resumes."""

import json
import os
import sys
from pathlib import Path

from distrib import cli


def main(path: str) -> int:
    runs = json.loads(Path(path).read_text())
    for name, env, overrides in runs:
        for other in runs:  # only this run's variables
            for key in other[1]:
                os.environ.pop(key, None)
        os.environ.update(env)
        if os.environ.get("RANK", "0") == "0":  # rank 0's lines until its next marker are this run's
            print(f"== run {name} ==", file=sys.stderr, flush=True)
        code = cli.main(["train", *[item for each in overrides for item in ("--set", each)]])
        if code:
            return code
    return 0


if __name__ == "__main__":
    cli.hard_exit(main(sys.argv[1]))
