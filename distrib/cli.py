"""argv in, exit code out: the only place that turns user errors into one-line messages.

    distrib train [--config FILE] [--set section.key=value ...] [--nproc-per-node N]
    distrib launch [torchrun options] SCRIPT|-m MODULE [args ...]
    distrib doctor
    distrib plot RUN_DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

from distrib.errors import EXIT_PREEMPTED, UserError, say

EXIT_USER_ERROR = 2


def _train(args: argparse.Namespace) -> int:
    from distrib.config import load_config
    from distrib.rundir import check_folders

    config = load_config(args.config, args.set)  # fail on a bad config before starting any worker
    _check_nproc(args.nproc_per_node)
    check_folders(config, probe_locks=True)  # writable and not another live run's (rank 0 then locks them)
    if args.nproc_per_node is not None:
        from distrib.launcher import launch_trainer

        return launch_trainer(args.nproc_per_node, args.argv)
    from distrib.preempt import StoppedEarly, exit_on_signals, parse_signals

    try:
        # A stop request outside the training steps (importing torch, waiting for the other ranks, after the final
        # checkpoint) ends this worker with EXIT_PREEMPTED at once: nothing is lost. The training steps take the
        # signals over (checkpoint at the next step boundary, then EXIT_PREEMPTED).
        with exit_on_signals(parse_signals(config.checkpoint.signals)):
            from torch.distributed.elastic.multiprocessing.errors import record

            return record(_worker)(config)  # under a launcher, a failing rank's exception reaches its summary
    except StoppedEarly as e:
        say(f"distrib: {e}; exit code {EXIT_PREEMPTED}: requeue the job and it starts (or resumes) there")
        return EXIT_PREEMPTED


def _check_nproc(nproc_per_node: int | None) -> None:
    if nproc_per_node is not None and nproc_per_node < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node}: must be at least 1 (workers on this node); "
                        "e.g. --nproc-per-node 2, or leave it out to run one process")


def _worker(config) -> int:
    from distrib.preempt import Preempted
    from distrib.worker import run

    try:
        run(config)
    except Preempted as e:
        say(f"distrib: {e}; exit code {EXIT_PREEMPTED}: requeue the job and it resumes there")
        return EXIT_PREEMPTED
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from distrib.doctor import main as doctor

    _check_nproc(args.nproc_per_node)
    return doctor(args.nproc_per_node)


def _plot(args: argparse.Namespace) -> int:
    from distrib.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distrib", description="Data-parallel training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model (one process, or N workers with --nproc-per-node)")
    train.add_argument("--config", help="TOML file; the built-in defaults train the seed Network on Fashion-MNIST")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value; repeatable")
    train.add_argument("--nproc-per-node", type=int, default=None,
                       help="launch this many workers on this node (a shorthand for distrib launch)")
    train.set_defaults(func=_train)
    # Listed for --help only: main() hands `launch` to torchrun's own parser before this one sees it.
    commands.add_parser("launch", help="torchrun-compatible launcher: distrib launch [torchrun options] "
                                       "SCRIPT|-m MODULE [args]; see distrib launch --help")
    doctor = commands.add_parser("doctor", help="print the launch environment and check it (GPUs, ports, SLURM)")
    doctor.add_argument("--nproc-per-node", type=int, default=None,
                        help="workers per node you plan to launch (default: from the environment, else GPUs)")
    doctor.set_defaults(func=_doctor)
    plot = commands.add_parser("plot", help="write a run's curves (loss, test accuracy, samples/s) as a PNG")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="the run.dir of a run (it holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/curves.png)")
    plot.set_defaults(func=_plot)
    return parser


def _launch_trainer_argv(argv: Sequence[str]) -> list[str]:
    """The train command line a launched worker runs: the user's, less --nproc-per-node."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc-per-node":
            skip = True
        elif not item.startswith("--nproc-per-node="):
            out.append(item)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["launch"]:  # passed through untouched, so every torchrun flag means what it means there
            from distrib.launcher import main as launch

            return launch(argv[1:])
        args = _parser().parse_args(argv)
        args.argv = _launch_trainer_argv(argv[1:])  # what follows `train`
        return args.func(args)
    except UserError as e:
        say(f"distrib: error: {e}")
        return getattr(e, "exit_code", EXIT_USER_ERROR)  # 2; EnvironmentFault: EXIT_ENVIRONMENT (74)


def hard_exit(code: int) -> NoReturn:
    """Ends the process without interpreter teardown: gloo's threads can otherwise SIGABRT at exit (pytorch#190489);
    the process group was already closed (barrier, then destroy) by the runtime."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry() -> None:
    """The console script and `python -m distrib`."""
    try:
        code = main()
    except SystemExit as e:  # argparse's own errors and --help
        code = e.code if isinstance(e.code, int) else 1
    hard_exit(code)
