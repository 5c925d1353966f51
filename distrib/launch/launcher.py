"""The parent process of `distrib launch` and `distrib train --nproc-per-node`: torchrun's own parser and elastic agent
(torch.distributed.run) with better defaults (arguments), SLURM and SkyPilot detection (clusters), and one line per
failed rank (agent, exits). The only writer of the launch environment, with environment's helpers (torch's agent sets
RANK and the rest for each worker; runtime.read_launch_env reads them)."""

from __future__ import annotations

import argparse
import os
from typing import Callable, Sequence

from distrib.errors import say
from distrib.launch import arguments, group_launches, replica_groups
from distrib.launch.agent import run_agent
from distrib.launch.allocator import worker_preload
from distrib.launch.environment import cpu_threads, oversubscribed, private_sockets, reporting_env
from distrib.launch.exits import stop_handlers


def main(argv: Sequence[str], check: Callable[[int, int | None], None] | None = None) -> int:
    """`distrib launch [torchrun options] SCRIPT|-m MODULE [args]`; returns the exit code. A stop signal from the
    first moment on ends it with the preemption code (the job is requeued), also before torch is imported.
    check(workers on this node, world_size) runs before any worker starts (world_size None when the node count is
    elastic). With --replica-groups G > 1 this node's workers run as G replica groups (group_launches.run_groups)."""
    with stop_handlers():
        args = arguments.apply_defaults(arguments.parse_args(argv), os.environ)
        arguments.check_rendezvous(args, os.environ)
        arguments.check_program(args)
        num_gpus, num_workers = arguments.visible_gpu_count(), arguments.local_world_size(args.nproc_per_node)
        replica_groups.settle(args, num_workers, os.environ)
        if check is not None:  # a replica group is a world of its own: its layout is checked at its size
            check(num_workers, num_workers // args.replica_groups if replica_groups.starts_groups(args)
                  else arguments.fixed_world_size(args))
        warning = oversubscribed(num_workers, num_gpus)
        if warning:
            say(warning)
        threads = cpu_threads(os.environ, num_workers, num_gpus)
        if threads is not None:
            # Set here, in the one writer of the launch environment; torch's agent passes it on to every worker.
            os.environ["OMP_NUM_THREADS"] = threads
        os.environ.update(worker_preload(os.environ, num_gpus))  # the workers' host allocator: tcmalloc if installed
        os.environ.update(private_sockets(os.environ, arguments.max_nodes_of(args.nnodes)))
        if replica_groups.starts_groups(args):  # each group's launch sets the rest of its workers' environment
            return group_launches.run_groups(args, argv, num_workers, num_gpus)
        os.environ.update(replica_groups.worker_env(args))  # this launch is one group: DISTRIB_REPLICA_GROUP, ...
        with reporting_env():
            return run_agent(args)


# The flags of distrib launch that distrib train takes too (True: the flag takes a value). distrib train hands them
# to main as given, where torch's own parser reads them (types, PET_* variables, defaults): each means exactly what
# it means to distrib launch and torchrun.
TRAIN_FLAGS = {"--nproc-per-node": True, "--nnodes": True, "--max-restarts": True, "--standalone": False,
               "--rdzv-backend": True, "--rdzv-endpoint": True, "--rdzv-id": True, "--rdzv-conf": True,
               "--node-rank": True, "--master-addr": True, "--master-port": True}


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """TRAIN_FLAGS on distrib train's parser, kept as text (parsing them imports no torch: a stop signal while
    `distrib train` starts still ends it with 75)."""
    group = parser.add_argument_group("launching (as for distrib launch; any of them starts the workers through it)")
    for flag, takes_value in TRAIN_FLAGS.items():
        if flag != "--nproc-per-node":  # distrib train's own: checked there, and shared with eval and predict
            group.add_argument(flag, **({"metavar": "VALUE"} if takes_value else {"action": "store_true"}),
                               help=f"as {flag} of distrib launch (torchrun)")


def train_flags(args: argparse.Namespace) -> list[str]:
    """The TRAIN_FLAGS that distrib train was given, as distrib launch's arguments."""
    given = []
    for flag, takes_value in TRAIN_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, False):
            given += [flag, str(value)] if takes_value else [flag]
    return given


def without_train_flags(argv: Sequence[str]) -> list[str]:
    """The command line a launched worker runs: the user's, less the TRAIN_FLAGS (--flag VALUE or --flag=VALUE)."""
    out, skip = [], False
    for item in argv:
        name, equals, _ = item.partition("=")
        if skip:
            skip = False
        elif name in TRAIN_FLAGS:
            skip = TRAIN_FLAGS[name] and not equals
        else:
            out.append(item)
    return out


def launch_trainer(launch_flags: Sequence[str], train_argv: Sequence[str],
                   check: Callable[[int, int | None], None] | None = None) -> int:
    """`distrib train --nproc-per-node N ...` (or any TRAIN_FLAGS): workers of `python -m distrib train ...` started
    as `distrib launch FLAGS -m distrib train ...` starts them; check as in main."""
    return main([*launch_flags, "-m", "distrib", "train", *train_argv], check)
