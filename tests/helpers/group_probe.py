"""A plain script (no torch: it starts in a blink) for the replica-group launch test: each worker writes the launch
variables it sees to OUT_DIR/g<GROUP>_r<RANK>_a<ATTEMPT>.json; group 1's rank 0 exits 1 on its first attempt once
group 0 and its own peer are running, and group 0 ends only once group 1's restarted workers have written theirs
(events, no sleeps).

    group_probe.py OUT_DIR
"""

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

KEYS = ("DISTRIB_REPLICA_GROUP", "TORCHFT_LIGHTHOUSE", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS")
WAIT_S = 300.0  # a missed event fails the test on this, far below its own timeout


def wait_for(paths: list[Path]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.05)


def main() -> None:
    out = Path(sys.argv[1])
    seen = {key: os.environ.get(key) for key in KEYS}
    group, rank, attempt = seen["DISTRIB_REPLICA_GROUP"], seen["RANK"], seen["TORCHELASTIC_RESTART_COUNT"]
    if group == "0" and rank == "0":  # the Lighthouse answers at the address the workers were given
        with urllib.request.urlopen(f"{seen['TORCHFT_LIGHTHOUSE']}/status", timeout=30) as reply:
            seen["lighthouse_status"] = reply.status
    name = out / f"g{group}_r{rank}_a{attempt}.json"
    name.with_suffix(".tmp").write_text(json.dumps(seen))
    name.with_suffix(".tmp").rename(name)
    if group == "1" and attempt == "0":
        # rank 0 fails only once its peer has written too: else, on a busy machine, the agent stops a rank 1 that has
        # not yet started, and its first attempt leaves no file
        wait_for([out / "g0_r0_a0.json", out / "g0_r1_a0.json", out / "g1_r1_a0.json"])
        sys.exit(1 if rank == "0" else 0)  # rank 1 ends too: else the agent stops it, and a test learns nothing
    if group == "0":
        wait_for([out / "g1_r0_a1.json", out / "g1_r1_a1.json"])


if __name__ == "__main__":
    main()
