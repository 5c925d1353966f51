"""argv in, exit code out: the only place that turns user errors into one-line messages.

    distrib train [--config FILE] [--set section.key=value ...] [--nproc-per-node N] [--max-restarts K] [--nnodes ...]
    distrib launch [torchrun options] SCRIPT|-m MODULE [args ...]
    distrib plan [--config FILE] [--set ...] (--nnodes N --nproc-per-node N | --world-size N) [--json] [--dry-run]
    distrib doctor
    distrib lighthouse [--min-replicas M] [--bind HOST:PORT] [--join-timeout-ms MS]
    distrib config [SECTION] [--toml | --markdown]
    distrib plot RUN_DIR [--out FILE]
    distrib eval RUN_DIR|CHECKPOINT [--config FILE] [--set ...] [--nproc-per-node N] [--out FILE]
    distrib predict RUN_DIR|CHECKPOINT --input FOLDER|test|train --out FILE [--config FILE] [--set ...] [...]
    distrib generate RUN_DIR --prompt TEXT --max-new-tokens N [--tokenizer PATH] [--temperature T --top-k K --seed S]

The parser is parser.py's; distrib train runs in train.py, the other commands in commands.py.
"""

from __future__ import annotations

import sys
from typing import Sequence

from distrib.cli.parser import parser
from distrib.errors import UserError, hard_exit, say
from distrib.launch.launcher import without_train_flags
from distrib.launch.reporting import told_elsewhere

EXIT_USER_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["launch"]:  # passed through untouched, so every torchrun flag means what it means there
            from distrib.launch.launcher import main as launch

            return launch(argv[1:])
        args = parser().parse_args(argv)
        args.argv = without_train_flags(argv[1:])  # what a launched worker runs after `distrib train` (eval, ...)
        return args.func(args)
    except UserError as e:
        if not told_elsewhere(e):
            say(f"distrib: error: {e}")
        return getattr(e, "exit_code", EXIT_USER_ERROR)  # 2; EnvironmentFault: EXIT_ENVIRONMENT (74)


def entry() -> None:
    """The console script and `python -m distrib`."""
    try:
        code = main()
    except SystemExit as e:  # argparse's own errors and --help
        code = e.code if isinstance(e.code, int) else 1
    hard_exit(code)
