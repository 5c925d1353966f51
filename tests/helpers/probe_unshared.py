"""Two ranks that do not share checkpoint.dir: each works in NODES/node<RANK> and resumes from the relative folder
"ck", as two nodes with a local disk each would. Prints each rank's outcome: `ok STEP` or `error MESSAGE`."""

import os
import sys
from pathlib import Path

from distrib.checkpoint import CheckpointError, Checkpoints, FileStorage
from distrib.config import DistConfig
from distrib.distributed.runtime import open_runtime

if __name__ == "__main__":
    with open_runtime(DistConfig(device="cpu", timeout_s=300)) as runtime:
        os.chdir(Path(sys.argv[1]) / f"node{runtime.rank}")
        try:
            checkpointer = Checkpoints(FileStorage(runtime), Path("ck"), runtime, dict, every_steps=0, keep_last=2)
            state = checkpointer.load("auto", lambda text: None)
            print(f"rank {runtime.rank} ok {state['progress']['step']}", flush=True)
        except CheckpointError as e:
            print(f"rank {runtime.rank} error {e}", flush=True)
