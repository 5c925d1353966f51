"""distrib train: the config and the launch checked before any worker starts, then N launched workers or this process
as the one worker, whose stop requests and failures end it with the exit codes a job script acts on."""

from __future__ import annotations

import argparse
import os

from distrib.errors import EXIT_PREEMPTED, UserError, say
from distrib.launch.clusters import check_pod, wants_launcher
from distrib.launch.launcher import launch_trainer, train_flags


def command(args: argparse.Namespace) -> int:
    from distrib.config import load_config
    from distrib.distributed import dimensions
    from distrib.distributed.runtime import read_launch_env
    from distrib.distributed.strategies import check_config
    from distrib.launch.rundir import check_folders
    from distrib.metrics import require_loggers

    config = load_config(args.config, args.set)  # fail on a bad config before starting any worker
    config = dimensions.worker_config(config, read_launch_env())  # a degree's own folders (a replica group's)
    check_config(config)  # and on a rule of its strategy (imports torch, as the launcher does anyway)
    check_nproc(args.nproc_per_node)
    check_folders(config, probe_locks=True)  # writable and not another live run's (rank 0 then locks them)
    require_loggers(config.metrics)  # a missing tracker package: one line here, not one per worker
    launch_flags = train_flags(args)  # --nproc-per-node, --max-restarts, --nnodes, --rdzv-*: as for distrib launch
    launch_flags += dimensions.launch_flags(config, os.environ)  # the degrees' own (a Lighthouse and its groups)
    if launch_flags or wants_launcher(os.environ):  # PET_* (a Kubeflow TrainJob) or SkyPilot: as distrib launch
        return launch_trainer(launch_flags, args.argv, before_workers(config))
    check_pod(os.environ)
    from distrib.launch.preempt import exit_on_signals, parse_signals
    from distrib.launch.reporting import errors_reported

    # A stop request outside the training steps (importing torch, waiting for the other ranks, after the final
    # checkpoint) ends this worker with EXIT_PREEMPTED at once: nothing is lost. The training steps take the
    # signals over (checkpoint at the next step boundary, then EXIT_PREEMPTED).
    # distrib launch says how its workers were stopped, and why: its workers stay quiet.
    with exit_on_signals(parse_signals(config.checkpoint.signals), announce=lambda: not errors_reported()):
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(worker)(config)  # under a launcher, a failing rank's exception reaches its summary


def before_workers(config):
    """What the launcher checks once, before any worker starts: the device each worker would get (CUDA present,
    enough GPUs), the layout at this world size (every parallel degree; the heads under tensor parallel) and the
    global batch's split over its data-parallel ranks."""
    def check(nproc_per_node: int, world_size: int | None) -> None:
        from distrib.config import check_world_size
        from distrib.distributed.runtime import select_device
        from distrib.plan.layout import check_layout

        select_device(config.dist.device, nproc_per_node - 1)  # the last local rank's device: all of them exist
        if world_size is not None:
            dims = check_layout(config, world_size, nproc_per_node)
            check_world_size(config.train.global_batch_size, config.train.grad_accum_steps, dims.batch_ranks)
    return check


def check_nproc(nproc_per_node: int | None) -> None:
    if nproc_per_node is not None and nproc_per_node < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node}: must be at least 1 (workers on this node); "
                        "e.g. --nproc-per-node 2, or leave it out to run one process")


def worker(config) -> int:
    from distrib.launch.preempt import Preempted
    from distrib.worker import run_training

    try:
        run_training(config)
    except Preempted as e:  # a SystemExit(75): entry() ends the process with it, as distrib.fit's scripts end
        if e.announce:  # rank 0's: one line for the run, not one per rank
            say(e.line())
        return EXIT_PREEMPTED
    return 0
