"""Replica groups: `distrib launch --replica-groups G` (and `distrib train` with dist.fault_tolerant_groups = G) on one
node starts torchft's Lighthouse and G ordinary launches of W/G workers, each restarted on its own; across nodes, each
group is one `distrib launch --replica-group g --lighthouse URL`. Here: the group flags, their checks, and what one
group's launch adds to its workers; the G launches of one node run in group_launches. The workers' side:
distrib.distributed.runtime."""

from __future__ import annotations

import argparse
import re
from typing import Mapping

from distrib.errors import UserError
from distrib.launch_env import GROUP_VAR, LIGHTHOUSE_VAR  # what a worker of group g reads (runtime.read_launch_env)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """distrib launch's own flags beside torchrun's (any order before the script, like them)."""
    group = parser.add_argument_group("replica groups (torchft fault tolerance; distrib launch's own flags)")
    group.add_argument("--replica-groups", type=int, default=1, metavar="G",
                       help="on this node: torchft's Lighthouse and G replica groups of --nproc-per-node / G workers, "
                            "each a world of its own, restarted on its own (--max-restarts each) while the others "
                            "go on; distrib train takes G from dist.fault_tolerant_groups")
    group.add_argument("--min-replicas", type=int, default=1, metavar="M",
                       help="replica groups a step needs after the first (the Lighthouse's min_replicas; "
                            "dist.min_replicas); default 1")
    group.add_argument("--replica-group", type=int, default=None, metavar="INDEX",
                       help="this launch is replica group INDEX of a run across nodes (default: "
                            "$DISTRIB_REPLICA_GROUP); needs --lighthouse")
    group.add_argument("--lighthouse-log", default=None, metavar="PATH",
                       help="where the Lighthouse that --replica-groups starts writes its warnings (distrib train: "
                            "run.dir/lighthouse.log); default: a temporary folder, removed when the run ends 0")
    group.add_argument("--lighthouse", default=None, metavar="URL",
                       help="a running torchft Lighthouse, http://HOST:PORT (default: $TORCHFT_LIGHTHOUSE); with "
                            "--replica-groups on one node none is started")


def settle(args: argparse.Namespace, num_workers: int, environ: Mapping[str, str]) -> None:
    """Fills --replica-group and --lighthouse from the environment, then checks the group flags against the launch:
    one line each (exit 2), before anything starts."""
    if args.replica_group is None and environ.get(GROUP_VAR, "") != "":
        args.replica_group = _whole(environ[GROUP_VAR], GROUP_VAR)
    args.lighthouse = args.lighthouse or environ.get(LIGHTHOUSE_VAR) or None
    groups, minimum = args.replica_groups, args.min_replicas
    if groups < 1:
        raise UserError(f"dist.fault_tolerant_groups = {groups} (--replica-groups {groups}): must be at least 1; "
                        "1 runs without torchft")
    if groups > 1 and not 1 <= minimum <= groups:
        raise UserError(f"dist.min_replicas = {minimum} (--min-replicas {minimum}): must be between 1 and the "
                        f"{groups} replica groups (dist.fault_tolerant_groups); 1 lets one live group go on alone")
    if args.replica_group is not None:
        _check_one_group(args)
    elif groups > 1:
        _check_local_groups(args, num_workers)


def _whole(text: str, source: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{source}={text!r}: not a whole number; give the replica group's index, e.g. 0") from None


def _check_one_group(args: argparse.Namespace) -> None:
    index, groups = args.replica_group, args.replica_groups
    if index < 0 or (groups > 1 and index >= groups):
        raise UserError(f"--replica-group {index} ({GROUP_VAR}): must be 0 .. {max(groups, 1) - 1}, one index per "
                        f"group of the {groups} (dist.fault_tolerant_groups)")
    if not args.lighthouse:
        raise UserError(f"--replica-group {index} ({GROUP_VAR}) without a Lighthouse: give --lighthouse "
                        f"http://HOST:29510 ({LIGHTHOUSE_VAR}), the address of the one the job started "
                        "(torchft_lighthouse --min_replicas M)")


def _check_local_groups(args: argparse.Namespace, num_workers: int) -> None:
    groups = args.replica_groups
    if num_workers % groups:
        fits = ", ".join(str(d) for d in range(1, num_workers + 1) if num_workers % d == 0)
        raise UserError(f"dist.fault_tolerant_groups = {groups} (--replica-groups {groups}) does not divide the "
                        f"{num_workers} workers of --nproc-per-node {num_workers}: each replica group takes W / G of "
                        f"them; give a G that divides {num_workers} ({fits}) or --nproc-per-node "
                        f"{groups * max(1, -(-num_workers // groups))}")
    if args.nnodes.split(":")[-1] != "1":
        raise UserError(f"--replica-groups {groups} with --nnodes {args.nnodes}: one distrib launch starts the groups "
                        "of one node; across nodes run one distrib launch per group with --replica-group INDEX "
                        f"({GROUP_VAR}) and --lighthouse URL ({LIGHTHOUSE_VAR}): see docs/clusters.md")
    if not args.standalone:
        raise UserError(f"--replica-groups {groups} with --rdzv-endpoint or --master-port: each replica group takes a "
                        "private rendezvous on a free port of its own, so one address cannot serve them all; leave "
                        "it out")


def starts_groups(args: argparse.Namespace) -> bool:
    """Whether this launch starts G replica groups of its own (else it is one ordinary launch)."""
    return args.replica_groups > 1 and args.replica_group is None


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """What the workers of one replica group get, beside torchrun's variables (empty when this launch is no group)."""
    if args.replica_group is None:
        return {}
    return {GROUP_VAR: str(args.replica_group), LIGHTHOUSE_VAR: args.lighthouse}


def tagged(args: argparse.Namespace, text: str) -> str:
    """The launcher's lines about its workers, naming the replica group they belong to (ranks repeat per group)."""
    if args.replica_group is None:
        return text
    return re.sub(r"^distrib launch: ", f"distrib launch: replica group {args.replica_group}: ", text, flags=re.M)

