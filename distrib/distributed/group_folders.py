"""Each fault-tolerant replica group's folders (group 0: run.dir itself, group g > 0: run.dir/replica_group_g), the
folders of the other groups, and how a group that comes back to a run another group has finished takes its final
state from them."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Callable

from distrib.distributed.runtime import Runtime
from distrib.errors import UserError

GROUP_FOLDER = "replica_group_{}"  # group g > 0 writes under run.dir/replica_group_g (group 0: run.dir itself)

__all__ = ["GROUP_FOLDER", "FinishedPeers", "group_config", "peer_config"]


def group_config(config, group: int):
    """The config replica group `group` runs: group 0 writes run.dir (and checkpoint.dir) as given, group g > 0 a folder
    of its own in them (replica_group_g), so that every group keeps its own log, metrics and checkpoints."""
    if config.dist.fault_tolerant_groups == 1 or group == 0:
        return config
    folder = GROUP_FOLDER.format(group)
    checkpoint = config.checkpoint
    if checkpoint.dir:
        checkpoint = dataclasses.replace(checkpoint, dir=str(Path(checkpoint.dir) / folder))
    return dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(Path(config.run.dir) / folder)),
                               checkpoint=checkpoint)


def peer_config(config, group: int, peer: int):
    """The config replica group `peer` runs, from the config of group `group` (group_config undone, then redone)."""
    if group != 0:
        checkpoint = config.checkpoint
        if checkpoint.dir:
            checkpoint = dataclasses.replace(checkpoint, dir=str(Path(checkpoint.dir).parent))
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(Path(config.run.dir).parent)),
                                     checkpoint=checkpoint)
    return group_config(config, peer)


@dataclasses.dataclass(frozen=True)
class FinishedPeers:
    """How a group that comes back to a run that another group has finished (it was lost near the end, or the run
    is started again) takes that group's final state: from its summary.json (the run is finished) and its newest
    checkpoint (the final state, committed before the summary is written). Without it the group would wait at the
    start barrier for groups that have ended."""

    config: object  # this group's config
    group: int
    total_steps: int
    checkpointer_at: Callable  # a config -> a Checkpointer of its checkpoint.dir (load only)

    def find(self) -> int | None:
        """Rank 0: a group whose summary.json says it trained every step of this run."""
        for peer in range(self.config.dist.fault_tolerant_groups):
            path = Path(peer_config(self.config, self.group, peer).run.dir) / "summary.json"
            if peer != self.group and path.exists():
                with contextlib.suppress(OSError, ValueError):
                    if json.loads(path.read_text()).get("steps") == self.total_steps:
                        return peer
        return None

    def take(self, peer: int, state, runtime: Runtime, global_batch_size: int, say) -> None:
        """Every rank of this group: the state at the end of the run, from group `peer`'s newest checkpoint."""
        checkpointer = self.checkpointer_at(peer_config(self.config, self.group, peer))
        loaded = checkpointer.load("auto", say)
        if loaded is None:
            raise UserError(f"replica group {peer} finished the run but its checkpoint.dir holds no checkpoint to take "
                            f"its final state from; copy {peer_config(self.config, self.group, peer).run.dir} or "
                            "train this group afresh in a new run.dir")
        state.load_state_dict(loaded, global_batch_size)
        if loaded["world_size"] == runtime.world_size:
            runtime.set_rng_state(loaded["rng"][runtime.rank])
