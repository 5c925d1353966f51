"""A plain torchrun-style script for the launcher tests: writes the launch variables its worker sees to
OUT_DIR/rank<R>.json after one all-reduce, and can die on purpose: probe_env.py OUT_DIR [exit|kill RANK], or wait
to be stopped: probe_env.py OUT_DIR sleep. Also model.factory functions whose rank 1 stalls, pauses, hangs or dies."""

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


def _network_that(act_on_rank1) -> "torch.nn.Module":
    """The seed Network, whose rank 1 calls act_on_rank1() in its third training forward (the third training step;
    the checks before training run in eval mode), after touching the file DISTRIB_TEST_ACTED names (if set): when it
    acted, for a test that times what follows."""
    from distrib.models.network import Network

    class Probe(Network):
        calls = 0

        def forward(self, x):
            Probe.calls += self.training
            if self.training and Probe.calls == 3 and dist.get_rank() == 1:
                if os.environ.get("DISTRIB_TEST_ACTED"):
                    Path(os.environ["DISTRIB_TEST_ACTED"]).touch()
                act_on_rank1()
            return super().forward(x)

    return Probe()


def stalling_network():
    """model.factory: rank 1 stops answering for 10 s, as a rank that skipped a collective (dist.timeout_s=3)."""
    return _network_that(lambda: time.sleep(10))


def hanging_network():
    """model.factory: rank 1 says so on stderr, then hangs (a 10-minute sleep) in its third forward."""
    def hang():
        sys.stderr.write("probe: rank 1 hangs\n")
        sys.stderr.flush()
        time.sleep(600)
    return _network_that(hang)


def pausing_network():
    """model.factory: rank 1 says so on stderr, then pauses for 15 s in its third forward, outside any collective: a
    test stops it there (SIGSTOP), and once continued it goes on at once (the pause's end has passed)."""
    def pause():
        sys.stderr.write("probe: rank 1 pauses\n")
        sys.stderr.flush()
        time.sleep(15)
    return _network_that(pause)


def dying_network():
    """model.factory: rank 1 is killed mid-training (SIGKILL, as the OOM killer does)."""
    return _network_that(lambda: os.kill(os.getpid(), signal.SIGKILL))


def network_dying_once(marker: str = "", at_forward: int = 0, rank: int = 3):
    """model.factory: `rank` is killed (SIGKILL) in its at_forward-th training forward unless `marker` exists, which
    it creates first: so the run's first attempt dies there and its restart does not. No marker: it never dies."""
    from distrib.models.network import Network

    class DiesOnce(Network):
        calls = 0

        def forward(self, x):
            DiesOnce.calls += self.training
            if marker and self.training and DiesOnce.calls == at_forward and dist.get_rank() == rank \
                    and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return super().forward(x)

    return DiesOnce()


def main() -> None:
    out = Path(sys.argv[1])
    seen = {key: value for key, value in os.environ.items() if key in KEYS or key.startswith("TORCHELASTIC_")}
    dist.init_process_group("gloo")  # env:// from exactly these variables: proves they work, not only exist
    total = torch.ones(1)
    dist.all_reduce(total)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({**seen, "all_reduce": int(total.item())}))
    if sys.argv[2:] == ["sleep"]:
        time.sleep(600)  # until the test stops it
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
