"""A plain torchrun-style script for the launcher tests: writes the launch variables its worker sees to
OUT_DIR/rank<R>.json after one all-reduce, and can die on purpose: probe_env.py OUT_DIR [exit|kill RANK]."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def main() -> None:
    out = Path(sys.argv[1])
    seen = {key: value for key, value in os.environ.items() if key in KEYS or key.startswith("TORCHELASTIC_")}
    dist.init_process_group("gloo")  # env:// from exactly these variables: proves they work, not only exist
    total = torch.ones(1)
    dist.all_reduce(total)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({**seen, "all_reduce": int(total.item())}))
    if len(sys.argv) > 3:
        how, victim = sys.argv[2], int(sys.argv[3])
        if dist.get_rank() == victim:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        time.sleep(600)  # survivors wait with no timeout of their own: only the launcher can end them
    dist.barrier()  # gloo ranks that leave while others still talk can abort at exit: barrier, destroy, _exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
