"""The c10d rendezvous of distrib launch, with one store bound to one address: a single-node run's on loopback, a
multi-node run's on the address --rdzv-endpoint names. torch's own c10d handler serves two stores, the rendezvous's
and the workers', on every interface (`*:PORT`), and c10d stores have no authentication, so anyone who can reach the
node could write into the job's; this handler serves both from one socket bound beforehand (TCPStore's
master_listen_fd)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import uuid
from pathlib import Path
from typing import Iterator

BACKEND = "distrib-c10d"  # the name torch's registry knows this handler by; users still say --rdzv-backend c10d
LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 29400  # torch's c10d default, for an endpoint given without a port


def private_args(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments torch's agent runs with: a c10d or standalone rendezvous becomes this module's handler (a
    standalone one on a free loopback port); others (static, etcd) are passed on as given."""
    if not (args.standalone or args.rdzv_backend == "c10d"):
        return args
    private = argparse.Namespace(**vars(args))
    if args.standalone:
        private.rdzv_endpoint, private.rdzv_id = f"{LOOPBACK}:0", str(uuid.uuid4())
    private.standalone, private.rdzv_backend = False, BACKEND
    return private


def loopback_interface() -> str:
    """The name of this machine's loopback network interface (Linux: lo), for GLOO_SOCKET_IFNAME."""
    with contextlib.suppress(OSError, ValueError):
        for device in sorted(Path("/sys/class/net").iterdir()):
            if int((device / "flags").read_text(), 16) & 0x8:  # IFF_LOOPBACK
                return device.name
    return "lo"


def _bound_listener(host: str, port: int) -> socket.socket | None:
    """A listening socket on host:port if host names an address of this machine and nobody else listens there;
    None when another process hosts the store (address in use) or host is another machine (address not here)."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore: TIME_WAIT leftovers are fine
        try:
            listener.bind(address)
            listener.listen(socket.SOMAXCONN)
            return listener
        except OSError as e:
            listener.close()
            if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise
    return None


def _open_store(params):
    """The rendezvous's TCPStore: served here from a socket bound to the endpoint's address when this machine has it
    (or --rdzv-conf is_host=1 says so), a client of it otherwise."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    is_host = params.get_as_bool("is_host")
    listener = _bound_listener(host, port) if is_host is not False else None
    if is_host and listener is None:
        raise ValueError(f"--rdzv-conf is_host=1 but {host}:{port} cannot be bound on this machine")
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60))
    if listener is None:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout), host, None
    port = listener.getsockname()[1]  # the real one when the endpoint said port 0
    store = dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=listener.fileno())
    return store, host, listener


def create_handler(params):
    """torch's dynamic rendezvous on the store above, the workers told to use that same store."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler

    store, host, listener = _open_store(params)
    inner = dynamic_handler(store, C10dRendezvousBackend(store, params.run_id), params)

    class PrivateRendezvous(RendezvousHandler):
        """Delegates to torch's handler; the workers (TORCHELASTIC_USE_AGENT_STORE) get MASTER_ADDR:MASTER_PORT of
        the rendezvous's own store, so no second one is served."""

        _listener = listener  # the bound socket: the store serves from it while this handler lives

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> RendezvousInfo:
            info = inner.next_rendezvous()
            return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(host, store.port))

        def is_closed(self) -> bool:
            return inner.is_closed()

        def set_closed(self) -> None:
            inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return inner.get_run_id()

        def shutdown(self) -> bool:
            return inner.shutdown()

    return PrivateRendezvous()


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """This handler in torch's registry, and torch's handler told to serve no store for the workers of its own
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE, read in each next_rendezvous), while inside."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)  # the same creator twice is allowed
    previous = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        else:
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = previous
