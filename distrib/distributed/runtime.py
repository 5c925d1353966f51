"""The per-worker runtime: reads the launch environment (the only reader), picks the device and backend, and opens
and always closes the process group (or adopts one already open, Ray Train's, and leaves it open). The only module
that picks a device or a backend (cuda/nccl, cpu/gloo): elsewhere
cuda is named only to count GPUs (doctor, launcher) or as a dist.device value (config)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import platform
import random
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from distrib.config import DistConfig
from distrib.distributed.hang import BUFFER_ENTRIES, BUFFER_VAR, HangWatch
from distrib.distributed.host_heap import keep_freed_memory, return_freed_memory
from distrib.distributed.peers import PeerWatch
from distrib.errors import CollectiveTimeoutError, PeerLostError, Preempted, UserError
from distrib.launch_env import GROUP_VAR as REPLICA_GROUP_VAR
from distrib.launch_env import HANG_NOTE_VAR, LIGHTHOUSE_VAR, die_with_parent


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """What the launcher (torchrun, distrib launch, or nothing) told this process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = ""
    master_port: int = 0
    restart_count: int = 0
    elastic: bool = False  # started by torch's elastic agent (torchrun, distrib launch): it dies with the agent
    node_rank: int = 0  # NODE_RANK (Ray Train) or GROUP_RANK (torchrun's agent); said, not used to compute ranks
    hang_note: str = ""  # distrib launch's file for the folder of hang dumps (distrib.distributed.hang)
    replica_group: int = 0  # REPLICA_GROUP_VAR: which fault-tolerant replica group this world is
    lighthouse: str = ""  # LIGHTHOUSE_VAR: the torchft Lighthouse's address

    @property
    def launched(self) -> bool:
        return bool(self.master_addr)


def _int_var(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    text = environ.get(key)
    if text is None:
        if default is None:
            raise UserError(f"{key} is not set but RANK is; launch with torchrun or distrib launch, "
                            "or unset RANK to run as one process")
        return default
    try:
        return int(text)
    except ValueError:
        raise UserError(f"{key}={text!r}: must be an integer; launch with torchrun or distrib launch") from None


def read_launch_env(environ: Mapping[str, str] = os.environ) -> LaunchEnv:
    """The single reader of RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK and MASTER_* (as torchrun, distrib
    launch and Ray Train's TorchTrainer set them), of distrib launch's HANG_NOTE_VAR, and of a fault-tolerant replica
    group's REPLICA_GROUP_VAR and LIGHTHOUSE_VAR; no env means one process."""
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return LaunchEnv(replica_group=_int_var(environ, REPLICA_GROUP_VAR, 0),
                         lighthouse=environ.get(LIGHTHOUSE_VAR, ""))
    rank, world_size = _int_var(environ, "RANK"), _int_var(environ, "WORLD_SIZE")
    local_rank = _int_var(environ, "LOCAL_RANK", rank)
    local_world_size = _int_var(environ, "LOCAL_WORLD_SIZE", world_size)
    master_addr = environ.get("MASTER_ADDR", "")
    master_port = _int_var(environ, "MASTER_PORT")
    if not master_addr:
        raise UserError("MASTER_ADDR is not set but RANK is; launch with torchrun or distrib launch")
    if not (0 <= rank < world_size):
        raise UserError(f"RANK={rank} with WORLD_SIZE={world_size}: need 0 <= RANK < WORLD_SIZE; fix the launcher")
    if not (0 <= local_rank < local_world_size <= world_size):
        raise UserError(f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_world_size}, WORLD_SIZE={world_size}: "
                        "need 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE; fix the launcher")
    restarts = _int_var(environ, "TORCHELASTIC_RESTART_COUNT", 0)
    node_rank = _int_var(environ, "NODE_RANK", _int_var(environ, "GROUP_RANK", 0))
    replica_group = _int_var(environ, REPLICA_GROUP_VAR, 0)
    if replica_group < 0:
        raise UserError(f"{REPLICA_GROUP_VAR}={replica_group}: must be 0 or more (the replica group's index); fix the "
                        "launcher or job script")
    return LaunchEnv(rank, local_rank, world_size, local_world_size, master_addr, master_port, restarts,
                     "TORCHELASTIC_RUN_ID" in environ, node_rank, environ.get(HANG_NOTE_VAR, ""), replica_group,
                     environ.get(LIGHTHOUSE_VAR, ""))


@dataclass(frozen=True, slots=True)
class Runtime:
    """Who this worker is and where it computes; everything below the worker takes one of these."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    restart_count: int = 0
    peers: PeerWatch | None = None  # the other ranks' heartbeats; None in one process
    replica_group: int = 0  # under dist.fault_tolerant_groups: this world's group, and the Lighthouse and this
    lighthouse: str = ""  # group's store (host:port, the launcher's) that torchft's Manager connects to
    store: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def ddp_device_ids(self) -> list[int] | None:
        # DDP wants the one device of a single-device CUDA module; CPU modules take None.
        return [self.device.index] if self.device.type == "cuda" else None

    @property
    def pin_memory(self) -> bool:
        return self.device.type == "cuda"

    @property
    def has_sync_batchnorm(self) -> bool:
        """torch's SyncBatchNorm runs on CUDA devices only."""
        return self.device.type == "cuda"

    @property
    def host_sync_is_free(self) -> bool:
        """Reading a value on the host costs nothing on the CPU; on an accelerator it drains the queue of work."""
        return self.device.type == "cpu"

    def free_memory_bytes(self) -> int:
        """Memory the device-resident data path may use: the GPU's free memory, or the host's available RAM."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def return_freed_host_memory(self) -> bool:
        """On the CPU, large tensors go back to the system when freed (host_heap.return_freed_memory); whether they
        do now. On a GPU the large transient tensors live on the device: nothing."""
        return self.device.type == "cpu" and return_freed_memory()

    def rng_state(self) -> dict:
        """This worker's random state: Python's, torch's CPU generator and its device's (what a resume or a healed
        replica group restores)."""
        device = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"python": random.getstate(), "torch": torch.get_rng_state(), "device": device}

    def set_rng_state(self, state: dict) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"].cpu())
        if self.device.type == "cuda" and state["device"] is not None:
            torch.cuda.set_rng_state(state["device"].cpu(), self.device)

    def replica_process_group(self, timeout: timedelta):
        """torchft's reconfigurable process group for the all-reduce across replica groups, of this worker's backend
        (torchft is an optional extra: imported here, only when fault-tolerant replica groups run)."""
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        return (ProcessGroupNCCL if self.backend == "nccl" else ProcessGroupGloo)(timeout=timeout)

    def peak_memory_bytes(self) -> int | None:
        """The most device memory this worker's tensors held at once (CUDA's caching allocator); None on the CPU."""
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def new_cpu_group(self) -> dist.ProcessGroup:
        """A gloo group of all ranks, for collectives that run on a background thread (asynchronous checkpoint
        writes) beside the training's own: two threads sharing one group would interleave their collectives.
        Every rank must call it, in the same order."""
        return dist.new_group(backend="gloo")

    def device_name(self) -> str:
        """The accelerator's marketing name ('NVIDIA H100 80GB HBM3'), or the CPU's; keys the peak FLOP/s table."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else cpu_name()


def cpu_name() -> str:
    """The host CPU's model name, from /proc/cpuinfo where there is one."""
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine() or "cpu"


def select_device(requested: str, local_rank: int) -> torch.device:
    """dist.device -> the worker's device; CUDA mistakes are caught here, before any process group exists."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("dist.device = 'cuda': CUDA is not available on this machine; "
                        "use --set dist.device=cpu (or auto)")
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise UserError(f"LOCAL_RANK={local_rank} but {visible} CUDA device(s) are visible; launch with "
                        f"--nproc-per-node={visible} or fix CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", local_rank)


# Process groups this process opened: a script may call distrib.fit more than once, and every rank does so alike.
_OPENED = itertools.count()


def _store_prefix(env: LaunchEnv, session: int) -> str:
    """Keys private to this restart and to this process group of it (the n-th one this process opened)."""
    return f"distrib/restart_{env.restart_count}/group_{session}"


def _connector(env: LaunchEnv, timeout: timedelta, session: int, name: str) -> Callable[[], dist.Store]:
    """A connection of its own to the launcher's store (the one env:// names), under this group's keys `name`/; its
    operations time out in 10 s at most, so a diagnosis never waits long on a store whose host is gone."""
    def connect() -> dist.Store:
        store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                              timeout=min(timeout, timedelta(seconds=10)))
        return dist.PrefixStore(f"{_store_prefix(env, session)}/{name}", store)
    return connect


def recorder_env(backend: str, hang_dir: Path) -> dict[str, str]:
    """What torch's flight recorder needs before the process group opens: its buffer and, on NCCL, torch's own dump
    when its watchdog sees a collective time out (it appends the rank to the file name)."""
    env = {BUFFER_VAR: str(BUFFER_ENTRIES)}
    if backend == "nccl":
        prefix = str(hang_dir / "rank_")
        env.update(TORCH_NCCL_DUMP_ON_TIMEOUT="1", TORCH_FR_DUMP_TEMP_FILE=prefix,
                   TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix)
    return env


def _recorded(hang_dir: Path, backend: str) -> Path:
    """hang_dir, once torch's flight recorder is set to record (read as the group opens; a user's settings stand)."""
    for key, value in recorder_env(backend, hang_dir).items():
        os.environ.setdefault(key, value)
    return hang_dir


def _watches(env: LaunchEnv, timeout: timedelta, session: int, backend: str,
             hang_dir: Path | None) -> tuple[PeerWatch, HangWatch | None]:
    """The heartbeats and, with a run folder, the hang dumps (distrib's on gloo, torch's own on NCCL)."""
    hangs = None
    if hang_dir is not None:
        note = Path(env.hang_note) if env.hang_note else None
        hangs = HangWatch(_connector(env, timeout, session, "hang"), env.rank, timeout.total_seconds(), hang_dir,
                          dumps=backend != "nccl", note=note).start()
    peers = PeerWatch(_connector(env, timeout, session, "peers"), env.rank, env.world_size, timeout.total_seconds(),
                      on_failure=hangs.failed if hangs is not None else None)
    return peers.start(), hangs


def _init_process_group(env: LaunchEnv, device: torch.device, backend: str, timeout: timedelta,
                        session: int) -> None:
    kwargs = dict(backend=backend, timeout=timeout, rank=env.rank, world_size=env.world_size)
    if device.type == "cuda":
        # A group that knows its device avoids barriers on the wrong GPU (pytorch#124714).
        kwargs["device_id"] = device
    if env.launched:
        # torch's env:// store (the elastic agent's, under torchrun), with keys private to this restart and group:
        # the agent keeps one store across restarts, and a stale peer address left by the previous attempt (or by
        # an earlier fit() of the same script) makes gloo's connect hang or fail.
        store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size, timeout=timeout))
        dist.init_process_group(store=dist.PrefixStore(_store_prefix(env, session), store), **kwargs)
    else:
        # One process, no launcher: an in-memory store, so no port is needed and none can clash.
        dist.init_process_group(store=dist.HashStore(), **kwargs)


def adopted_backend(env: LaunchEnv, backend: str) -> bool:
    """Whether a process group is already open in this process (Ray Train's TorchTrainer opens one before its
    train_loop_per_worker runs): then it is adopted, if it matches the launch environment and can serve the device's
    backend (the device decides: dist.device; an open group that cannot serve it is the mistake)."""
    if not dist.is_initialized():
        return False
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (rank, world_size) != (env.rank, env.world_size):
        raise UserError(f"an open process group of rank {rank}, world size {world_size}, but the launch environment "
                        f"says RANK={env.rank}, WORLD_SIZE={env.world_size}: open the group with the launcher's "
                        "RANK and WORLD_SIZE, or let distrib open it")
    opened = dist.get_backend()  # "gloo", "nccl", or "cpu:gloo,cuda:nccl"
    if backend not in re.split(r"[,:]", opened):
        raise UserError(f"an open process group of backend {opened!r}, but this run's device needs {backend!r}: "
                        f"{'use_gpu=True (nccl)' if backend == 'nccl' else 'use_gpu=False (gloo)'} in Ray's "
                        "ScalingConfig, or --set dist.device to match the group")
    return True


@contextlib.contextmanager
def open_runtime(config: DistConfig, env: LaunchEnv | None = None, run_dir: Path | None = None) -> Iterator[Runtime]:
    """Opens the process group for this worker and always closes it, also when training raises. A group already open
    (Ray Train's) is adopted and left open for its owner: no heartbeats then, and its own timeout holds. With
    run_dir, a collective that outwaits the timeout leaves every rank's trace in run_dir/hang (distrib.distributed.
    hang)."""
    env = env or read_launch_env()
    if env.elastic:
        # A worker of torchrun or distrib launch ends when its launcher does, even by SIGKILL (distrib launch's
        # workers already are tied by distrib.lifeline; under torchrun this is the only tie). Not for processes a
        # script of the user's started with RANK and MASTER_* set: that script may end before them on purpose.
        die_with_parent()
    device = select_device(config.device, env.local_rank)
    if device.type == "cpu":  # tensors in host memory: keep what each step frees (distrib.distributed.host_heap)
        keep_freed_memory()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank allocates on GPU 0
    backend = "nccl" if device.type == "cuda" else "gloo"
    adopted = adopted_backend(env, backend)
    timeout = timedelta(seconds=config.timeout_s)
    session = next(_OPENED)
    # The watches connect to the store distrib's own group uses; an adopted group's store is its owner's.
    watched = env.launched and env.world_size > 1 and not adopted
    hang_dir = _recorded(Path(run_dir) / "hang", backend) if watched and run_dir is not None else None
    if not adopted:
        _init_process_group(env, device, backend, timeout, session)
    ok, peers, hangs = False, None, None
    try:
        peers, hangs = _watches(env, timeout, session, backend, hang_dir) if watched else (None, None)
        yield Runtime(env.rank, env.local_rank, env.world_size, env.local_world_size, device, backend,
                      env.restart_count, peers, env.replica_group, env.lighthouse,
                      f"{env.master_addr}:{env.master_port}" if env.launched else "")
        ok = True
    except Preempted:
        ok = True  # every rank stopped at the same step boundary, after the same save: all reach the barrier
        raise
    finally:
        for watch in (peers, hangs):
            if watch is not None:
                watch.stop()
        close_process_group(barrier=ok, destroy=not adopted)


def close_process_group(barrier: bool = True, destroy: bool = True) -> None:
    """Barrier, then destroy: a gloo rank that leaves while others still talk to it can abort at exit. An adopted
    group (destroy=False) gets the barrier only: its owner destroys it."""
    if not dist.is_initialized():
        return
    if barrier:
        with contextlib.suppress(Exception):
            dist.barrier()
    if destroy:
        dist.destroy_process_group()
        # A process group kept by a reference cycle is freed at the next collection: here, in this process, not in
        # a DataLoader worker forked later by another run in it (distrib.data.batching.init_worker).
        gc.collect()


# Words in gloo's and NCCL's errors: the collective outwaited the timeout, or a peer's connection broke (it died).
_TIMEOUT_WORDS = ("timed out", "timeout")
_LOST_WORDS = ("connection closed", "connection reset", "connection refused", "broken pipe", "closed by peer",
               "socket closed", "remote process exited", "econnreset", "epipe")


@contextlib.contextmanager
def collective_timeouts(timeout_s: float, where: Callable[[], str], peers: PeerWatch | None = None) -> Iterator[None]:
    """Turns a collective that outwaited dist.timeout_s, or lost a peer that died, into one line that says where
    training was and names the ranks that did not arrive (host, pid, last step, still beating or not, from the
    heartbeats), instead of gloo's traceback. (NCCL's watchdog may abort the process instead; its log names the
    collective.)"""
    if peers is not None:
        peers.where = where
        peers.beat()  # at once: the last beat of a rank that stops soon must not say "before training"
    try:
        yield
    except RuntimeError as e:  # gloo raises RuntimeError; torch's DistBackendError is one too
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        text = re.sub(r"^\[\S+\]\s*", "", text)  # gloo's "[.../unbound_buffer.cc:78] " source prefix
        text = re.split(r"(?<=\.)\s", text)[0]  # its first sentence: the rest is gloo's general advice
        lowered = text.lower()
        if any(word in lowered for word in _TIMEOUT_WORDS):
            missing = peers.diagnose("timeout") if peers is not None else ""
            raise CollectiveTimeoutError(
                f"{where()}: a collective waited longer than dist.timeout_s = {timeout_s:g} s ({text[:200]}); "
                + (f"did not arrive: {missing}; " if missing else "another rank stopped or ran collectives this "
                   "one did not (rank-0-only evaluation or saving?), see the other ranks' errors; ")
                + "raise dist.timeout_s if a rank is only slow") from None
        if any(word in lowered for word in _LOST_WORDS):
            missing = peers.diagnose("lost") if peers is not None else ""
            raise PeerLostError(f"{where()}: lost {missing or 'a peer'} ({text[:200]}); this rank stopped too: "
                                "the lost rank's own error says why",
                                told_elsewhere=bool(missing) and not peers.first_to_tell("lost")) from None
        raise
    finally:
        if peers is not None:
            peers.where = lambda: "after training"
