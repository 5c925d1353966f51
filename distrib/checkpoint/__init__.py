"""Checkpoints: the complete training state, written atomically and verified, as one file (ddp) or as DCP shards
(fsdp) that reshard on load; which checkpoint a run resumes, who owns a folder, pruning, and the best k."""

from distrib.checkpoint.best import BestCheckpoints
from distrib.checkpoint.format import Checkpointer, CheckpointError
from distrib.checkpoint.sharded import ShardedCheckpointer, make_checkpointer

__all__ = ["BestCheckpoints", "CheckpointError", "Checkpointer", "ShardedCheckpointer", "make_checkpointer"]
