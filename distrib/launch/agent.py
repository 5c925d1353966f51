"""torch's elastic agent (torch.distributed.run.run) as distrib launch runs it: each worker under a lifeline, the
stop signals passed on, and its failures (a worker's, the rendezvous') turned into one line each and an exit code
instead of tracebacks."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from pathlib import Path

from distrib.errors import UserError, say
from distrib.launch import replica_groups
from distrib.launch.arguments import fixed_world_size
from distrib.launch.environment import lifelines
from distrib.launch.exits import exit_code, signal_exit_code, stop_handlers, stopped_line
from distrib.launch.lifeline import read_statuses
from distrib.launch.reporting import failure_lines, hang_line, quiet_torch_failure_lines, restart_line


def run_agent(args: argparse.Namespace) -> int:
    """torch.distributed.run.run, each worker under a lifeline, its failures turned into messages and exit codes
    instead of tracebacks."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from distrib.launch import rendezvous
    from distrib.launch.lifeline import read_attempt

    def signal_exception(signum: int) -> SignalException:  # what torch's own handler raises
        return SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    def restarting() -> None:  # torch's agent stopped a failed attempt's workers: say who failed it, if it restarts
        with contextlib.suppress(Exception):  # called inside torch's logging call: never break the agent's restart
            line = restart_line(*read_attempt(status), args.max_restarts)
            if line:
                say(replica_groups.tagged(args, line))

    started_ns = time.time_ns()
    with lifelines(args) as status, stop_handlers(signal_exception), quiet_torch_failure_lines(restarting), \
            rendezvous.registered():
        try:
            torchrun.run(rendezvous.private_args(args))
        except SignalException as e:
            return _stopped(args, status, int(e.sigval))
        except ChildFailedError as e:
            return _failed(args, status, e, started_ns)
        except RendezvousError as e:
            raise UserError(f"rendezvous {args.rdzv_backend} at {args.rdzv_endpoint!r} (id {args.rdzv_id}) failed: "
                            f"{e}; check that every node runs the same --nnodes, --rdzv-endpoint and --rdzv-id") \
                from None
        except (DistStoreError, DistNetworkError) as e:
            if args.rdzv_backend != "static":
                raise
            raise _static_rendezvous_error(args, e) from None
    return 0


def _stopped(args: argparse.Namespace, status: Path, signum: int) -> int:
    """After a stop signal: the agent has already passed it on to the workers and waited for them."""
    codes = [worker.code for worker in read_statuses(status)]
    code = signal_exit_code(signum, codes)
    say(replica_groups.tagged(args, stopped_line(signum, codes, code)))
    return code


def _failed(args: argparse.Namespace, status: Path, error, started_ns: int) -> int:
    """A worker failed and the restarts are spent: one line per failed rank, and where ranks diverged if they hung."""
    workers = read_statuses(status)  # a lifeline torch's agent SIGKILLed after its grace left no code
    lines = failure_lines(error, {worker.pid: worker.worker_pid for worker in workers},
                          {worker.pid for worker in workers if worker.code is None})
    hang = hang_line(status.parent / "hang_note", started_ns, fixed_world_size(args))  # where ranks diverged
    say(replica_groups.tagged(args, "\n".join(lines + ([hang] if hang else []))))
    return exit_code(error)


def _static_rendezvous_error(args: argparse.Namespace, error: Exception) -> UserError:
    """torchrun's static rendezvous (PET_* from a TrainJob, SkyPilot): node 0's store waits for every node."""
    return UserError(f"rendezvous at {args.master_addr}:{args.master_port}: not all {args.nnodes} nodes "
                     f"(--nnodes, PET_NNODES) arrived as node {args.node_rank} waited "
                     f"({str(error).splitlines()[0]}); every node needs the same node count, a node rank below "
                     "it, and node 0 up")
