"""Two ranks that do not share checkpoint.dir: each works in NODES/node<RANK> and resumes from the relative folder
"ck", as two nodes with a local disk each would. Writes each rank's outcome, `rank R ok STEP` or `rank R error
MESSAGE`, to NODES/rankR.txt (a file each: on stdout one rank's line went missing in about 1 run of 3)."""

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
            outcome = f"ok {state['progress']['step']}"
        except CheckpointError as e:
            outcome = f"error {e}"
        (Path(sys.argv[1]) / f"rank{runtime.rank}.txt").write_text(f"rank {runtime.rank} {outcome}\n")
