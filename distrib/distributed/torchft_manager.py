"""torchft's Manager of one fault-tolerant replica group (distrib.distributed.fault_tolerance): made so that a
restarted group reads none of its dead self's keys in the group's store, which outlives a restart, and so that
torchft's log says a lost group in one line."""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta

import torch.distributed as dist

from distrib.distributed.group_folders import GROUP_FOLDER
from distrib.distributed.runtime import Runtime

# What torchft's Manager keeps, unprefixed, in its group's store: a restarted group must not read its dead self's.
_MANAGER_KEYS = ("manager_addr", "replica_id")


def _forget_dead_manager(runtime: Runtime) -> None:
    """The keys torchft's Manager leaves in the launcher's store, which outlives a restart: rank 0 deletes them before
    its new Manager writes them again, and the group's barrier keeps the others from reading the old ones."""
    if runtime.world_size == 1:
        return
    if runtime.is_main:
        host, port = runtime.store.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        for name in _MANAGER_KEYS:
            store.delete_key(name)
    dist.barrier()


class _StorePort(int):
    """The port of the group's store, which torchft also formats into the address of the keys of its collectives
    across the groups (f"{store_addr}:{store_port}", then "/torchft/{quorum_id}/..."): formatted with a prefix of this
    worker's own, since the store outlives a restart and a Lighthouse started again counts quorum ids from 1 again, so
    a restarted group would read a dead worker's address under the same quorum id (gloo: connection refused)."""

    def __new__(cls, port: int, prefix: str):
        made = super().__new__(cls, port)
        made.prefix = prefix
        return made

    def __format__(self, spec: str) -> str:
        return f"{int(self)}/{self.prefix}"


class _OneLine(logging.Filter):
    """torchft's line for a collective that lost a group, without the traceback it appends: a lost group is the
    expected event here, retried without it (the log's next lines say how many groups take part)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def make_manager(config, runtime: Runtime):
    """torchft's Manager of this group: synchronous quorums (a heal is applied before the step's forward, so the
    healed group takes part in that very step), no initial sync (every group builds the same weights from
    train.seed), dist.fault_tolerant_timeout_s for the all-reduce across the groups, dist.timeout_s for the rest."""
    # torchft's Rust side logs every quorum and commit at INFO (read once, at its import): warnings and errors only,
    # unless the user asks for more.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.manager import Manager

    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(known, _OneLine) for known in logger.filters):
        logger.addFilter(_OneLine())

    _forget_dead_manager(runtime)
    timeout = timedelta(seconds=config.dist.timeout_s)
    host, port = runtime.store.rsplit(":", 1)
    collectives = timedelta(seconds=config.dist.fault_tolerant_timeout_s)
    return Manager(pg=runtime.replica_process_group(collectives), load_state_dict=None, state_dict=None,
                   min_replica_size=config.dist.min_replicas, use_async_quorum=False, timeout=timeout,
                   quorum_timeout=timeout, connect_timeout=timeout, rank=runtime.rank, world_size=runtime.world_size,
                   store_addr=host, store_port=_StorePort(int(port), f"worker_{uuid.uuid4().hex[:12]}"),
                   lighthouse_addr=runtime.lighthouse,
                   replica_id=GROUP_FOLDER.format(runtime.replica_group), init_sync=False)
