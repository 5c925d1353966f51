"""`distrib lighthouse`: torchft's Lighthouse (the quorum server of fault-tolerant replica groups) in this process
until a stop signal; what `distrib launch --replica-groups` starts on one node (start_lighthouse), and a job script's
own step."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from distrib import torch_private
from distrib.errors import UserError, say
from distrib.launch.lifeline import child_setup

DEFAULT_BIND = "[::]:29510"  # torchft_lighthouse's own default
# How long a quorum waits for a group that heartbeats but has not asked to join (torchft_lighthouse: 60 s). Short, as
# the groups that go on wait this long for a restarted group that is still starting; the start barrier (the first
# quorum waits for every group) is the workers' own.
JOIN_TIMEOUT_MS = 5000
HEARTBEAT_TIMEOUT_MS = 5000  # a group silent this long is left out of the next quorum (torchft's default)
# How often a quorum that waits for groups is checked (torchft_lighthouse: 100 ms): a step whose groups ask at
# different moments waits for the next tick.
QUORUM_TICK_MS = 10
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
LIGHTHOUSE_START_S = 120.0  # `distrib lighthouse` imports no torch: under a second on a quiet machine


def lighthouse_server_class():
    """torchft's LighthouseServer, without importing torch (torch_private.lighthouse_server_class says why)."""
    server = torch_private.lighthouse_server_class()
    if server is None:
        raise UserError("fault-tolerant replica groups need torchft, which is not installed: "
                        "pip install 'distrib[ft]' (torchft 0.2.0)")
    return server


def address(bind: str, server_address: str) -> str:
    """The URL the groups use: the bound host, or this machine's name when bound to every interface."""
    host, _, _ = bind.rpartition(":")
    port = server_address.rpartition(":")[2]
    if host in ("", "[::]", "0.0.0.0", "*"):
        host = socket.gethostname()
    return f"http://{host}:{port}"


def serve(min_replicas: int, bind: str = DEFAULT_BIND, join_timeout_ms: int = JOIN_TIMEOUT_MS) -> int:
    """Runs the Lighthouse until SIGTERM, SIGINT or SIGUSR1; says its address on stderr first (one line)."""
    import signal

    from distrib.launch.preempt import signal_handlers

    if min_replicas < 1:
        raise UserError(f"--min-replicas {min_replicas}: must be at least 1 (dist.min_replicas)")
    # torchft's Rust side logs every quorum request at INFO (read once, at its import): warnings and errors only,
    # unless the user asks for more; a group waiting for the others asks twice a second.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        server = lighthouse_server_class()(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                           quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    except RuntimeError as e:
        raise UserError(f"distrib lighthouse --bind {bind}: cannot serve there ({e}); give a free HOST:PORT") from None
    stop = threading.Event()
    with signal_handlers([getattr(signal, name) for name in STOP_SIGNALS], lambda signum, frame: stop.set()):
        say(f"distrib lighthouse: listening at {address(bind, server.address())} (min_replicas {min_replicas}, "
            f"join timeout {join_timeout_ms} ms)")
        while not stop.wait(1.0):
            pass
    server.shutdown()
    return 0


def start_lighthouse(min_replicas: int, log: Path, port: int = 0) -> tuple[subprocess.Popen, str]:
    """`distrib lighthouse` on a loopback port (no other machine reaches it; 0: a free one), appending to log (its
    warnings only: lighthouse.serve); returns the process and its address once it listens. A process of its own,
    whose lines stay out of the run's output."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        start = out.tell()  # a Lighthouse started again appends: its own line is read after what is there
        proc = subprocess.Popen([sys.executable, "-m", "distrib", "lighthouse", "--bind", f"127.0.0.1:{port}",
                                 "--min-replicas", str(min_replicas)], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=child_setup(os.getpid()))
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while time.monotonic() < deadline and proc.poll() is None:
        listening = re.search(rb"distrib lighthouse: listening at (\S+)", log.read_bytes()[start:])
        if listening:
            return proc, listening.group(1).decode()
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
    raise UserError(f"torchft's Lighthouse did not start (exit {proc.wait()}: {last[0]}); its log: {log}")
