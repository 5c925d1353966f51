"""Ranks that do not share their folders: each works in NODES/node<RANK>, as nodes with a local disk each would.
First each resumes from the relative checkpoint.dir "ck"; then each takes the relative run.dir "run" as a sharded
run does (every rank writes its part of the weights there). Writes each rank's two outcomes, `rank R ok ...` or
`rank R error MESSAGE`, one a line, to NODES/rankR.txt (a file each: on stdout one rank's line went missing in about
1 run of 3)."""

import os
import sys
from pathlib import Path

from distrib.checkpoint import CheckpointError, Checkpoints, FileStorage
from distrib.config import DistConfig, load_config
from distrib.distributed.runtime import open_runtime
from distrib.errors import UserError
from distrib.launch.rundir import own_folders


def resume(runtime) -> str:
    try:
        checkpointer = Checkpoints(FileStorage(runtime), Path("ck"), runtime, dict, every_steps=0, keep_last=2)
        state = checkpointer.load("auto", lambda text: None)
        return f"ok {state['progress']['step']}"
    except CheckpointError as e:
        return f"error {e}"


def take_run_dir(runtime) -> str:
    config = load_config(None, ["run.dir=run", "dist.strategy=fsdp", "dist.device=cpu"])
    try:
        with own_folders(config, runtime, every_rank_writes=True):
            return "ok run.dir"
    except UserError as e:
        return f"error exit {e.exit_code}: {e}"


if __name__ == "__main__":
    with open_runtime(DistConfig(device="cpu", timeout_s=300)) as runtime:
        os.chdir(Path(sys.argv[1]) / f"node{runtime.rank}")
        outcomes = [resume(runtime), take_run_dir(runtime)]
        (Path(sys.argv[1]) / f"rank{runtime.rank}.txt").write_text(
            "".join(f"rank {runtime.rank} {outcome}\n" for outcome in outcomes))
