"""Several `distrib train` runs in one launch of workers (torchrun or `distrib launch`), so that they share its
process start-up: each run as a launched worker of `distrib train` runs it (distrib.cli.main, which opens and closes
its own process group), with environment variables of its own.

    python tests/helpers/train_runs.py RUNS.json [CODES.json]
    RUNS.json: [[NAME, {"VAR": "VALUE"}, ["section.key=value", ...]]]

Ends with the first non-zero exit code of a run; with CODES.json, runs them all and writes {NAME: exit code} there,
unless a run lost a peer (exit 69: the process group is broken, and the launcher stops or restarts every worker; going
on would wait in the next run's rendezvous until the launcher's grace period kills it).
Restarted by `distrib launch --max-restarts`, it runs them again: a finished run then trains nothing, the interrupted
one resumes. With TRAIN_RUNS_PEAKS=FOLDER in the launch's environment, each rank writes FOLDER/peaks_RANK.json:
{NAME: its peak resident bytes so far} after each run (a small run first makes the baseline of a larger one's).
With TRAIN_RUNS_CUT=FILE among a run's variables, rank 0 cuts FILE to half its bytes before the run starts (a
checkpoint damaged between two runs)."""

import json
import os
import resource
import sys
from pathlib import Path

from distrib import cli
from distrib.errors import EXIT_HUNG


def main(path: str, codes_path: str | None = None) -> int:
    runs, codes = json.loads(Path(path).read_text()), {}
    for name, env, overrides in runs:
        for other in runs:  # only this run's variables
            for key in other[1]:
                os.environ.pop(key, None)
        os.environ.update(env)
        if os.environ.get("RANK", "0") == "0":  # rank 0's lines until its next marker are this run's
            print(f"== run {name} ==", file=sys.stderr, flush=True)
            _cut(os.environ.get("TRAIN_RUNS_CUT"))  # rank 0 alone picks the checkpoint, after this
        codes[name] = cli.main(["train", *[item for each in overrides for item in ("--set", each)]])
        _record_peak(name)
        if codes[name] and (codes_path is None or codes[name] == EXIT_HUNG):
            return codes[name]
    if codes_path is not None:
        Path(codes_path).write_text(json.dumps(codes))
    return 0


def _cut(path: str | None) -> None:
    if path:
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[:len(data) // 2])


def _record_peak(name: str) -> None:
    folder = os.environ.get("TRAIN_RUNS_PEAKS")
    if folder:
        path = Path(folder) / f"peaks_{os.environ.get('RANK', '0')}.json"
        peaks = json.loads(path.read_text()) if path.exists() else {}
        peaks[name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        path.write_text(json.dumps(peaks))


if __name__ == "__main__":
    cli.hard_exit(main(*sys.argv[1:3]))
