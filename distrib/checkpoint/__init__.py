"""Checkpoints: the complete training state, written atomically and verified, as one file (ddp) or as DCP shards
(fsdp, any DTensor layout) that reshard on load; and, written once above both formats, which checkpoint a run
resumes, who owns a folder, pruning, the best k, and the temporary files of dead writers. Beside them, a model's
weights alone: written as safetensors shard by shard (weights), read from pretrained sources (init_from)."""

from distrib.checkpoint.best import BestCheckpoints
from distrib.checkpoint.contract import Checkpointer, Storage
from distrib.checkpoint.format import CheckpointError, FileStorage
from distrib.checkpoint.policy import Checkpoints, committing, make_checkpointer
from distrib.checkpoint.sharded import ShardedStorage

__all__ = ["BestCheckpoints", "CheckpointError", "Checkpointer", "Checkpoints", "FileStorage", "ShardedStorage",
           "Storage", "committing", "make_checkpointer"]
