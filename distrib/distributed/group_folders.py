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
# Written in a group's run.dir by its rank 0 when its training loop ends (its final checkpoint taken), before its
# final evaluation and summary.json: a group waiting at the start barrier then waits for that summary, however long
# the evaluation takes, instead of giving up after dist.timeout_s.
TRAINING_ENDED = "training_ended.json"
EARLY_STOP = "early_stop"  # the trainer's stop_reason (summary.json, TRAINING_ENDED) of a run that stopped early

__all__ = ["EARLY_STOP", "GROUP_FOLDER", "TRAINING_ENDED", "FinishedPeers", "group_config", "peer_config"]


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

    said: set = dataclasses.field(default_factory=set, compare=False)  # the peers whose evaluation was waited for

    def find(self) -> int | None:
        """Rank 0: a group whose summary.json says the run is finished (see ended)."""
        return next(self._peers("summary.json"), None)

    def awaits(self, say) -> bool:
        """Rank 0: whether a group's training loop ended (its TRAINING_ENDED says the run is finished, its final
        checkpoint taken) with its summary.json not written yet: its final evaluation runs, which may take longer
        than dist.timeout_s, and this group waits for it (said once per peer). A group that dies evaluating is
        restarted by its launcher and evaluates again, or its spent restarts end the run."""
        peer = next(self._peers(TRAINING_ENDED), None)
        if peer is not None and peer not in self.said:
            self.said.add(peer)
            say(f"replica group {self.group}: group {peer}'s training ended; waiting for its final evaluation and "
                "summary.json to take its final state")
        return peer is not None

    def training_ended(self, step: int, stop_reason: str) -> None:
        """Rank 0 of this group, its training loop ended: TRAINING_ENDED in its run.dir, written whole."""
        path = Path(self.config.run.dir) / TRAINING_ENDED
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps({"steps": step, "stop_reason": stop_reason}))
        part.replace(path)

    def _peers(self, name: str):
        """The other groups whose file `name` in their run.dir says the run is finished."""
        for peer in range(self.config.dist.fault_tolerant_groups):
            path = Path(peer_config(self.config, self.group, peer).run.dir) / name
            if peer != self.group and path.exists():
                with contextlib.suppress(OSError, ValueError):
                    if self.ended(json.loads(path.read_text())):
                        yield peer

    def ended(self, record) -> bool:
        """Whether a group's summary.json (or TRAINING_ENDED) says the run is finished: it stopped early (its
        stop_reason), or trained every step of this run (a run since extended, its train.max_steps raised, is not)."""
        return isinstance(record, dict) and (record.get("stop_reason") == EARLY_STOP
                                             or record.get("steps") == self.total_steps)

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

