"""The elastic agent's rendezvous, bound to one address.

torch's c10d rendezvous backend starts its TCPStore on every interface (``[::]``) with no way to name
one. This registers the same backend under the name ``BACKEND``, with the hosting node's store served on
a socket bound to the endpoint's address only (127.0.0.1 for a job on one machine). Everything else is
torch's: the dynamic rendezvous, its state in the store, the agent that uses it.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from trainscale.runtime.network import listening_socket

BACKEND = "trainscale-c10d"
DEFAULT_PORT = 29400

_held: dict[tuple[str, int], socket.socket] = {}  # (host, port) -> a socket listening there, for bound_store


@contextlib.contextmanager
def held_endpoint(host: str) -> Iterator[str]:
    """``host:PORT`` with a free PORT that this process listens on from now until its rendezvous store takes the
    socket (``bound_store``). A port found free and bound later, when torch's agent creates the store, could be
    taken by another process in between: a failed start on a busy machine. Closed on exit if no store took it."""
    sock = listening_socket(host, 0)
    port = sock.getsockname()[1]
    _held[(host, port)] = sock
    try:
        yield f"{host}:{port}"
    finally:
        left = _held.pop((host, port), None)
        if left is not None:
            left.close()


def bound_store(
    host: str, port: int, is_host: bool, timeout: datetime.timedelta, world_size: int | None = None
) -> dist.TCPStore:
    """A TCPStore whose server (when ``is_host``) listens on ``host:port`` only (on the socket ``held_endpoint``
    holds there, if any); a client otherwise."""
    if not is_host:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = _held.pop((host, port), None) or listening_socket(host, port)
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())


class BoundC10dBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state, under this backend's name (the registry checks the two agree)."""

    @property
    def name(self) -> str:
        return BACKEND


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    store = bound_store(host, port, bool(params.get_as_bool("is_host")), timeout)
    return create_handler(store, BoundC10dBackend(store, params.run_id), params)


def register_backend() -> str:
    """Make ``BACKEND`` known to torch's rendezvous registry (idempotent); returns its name for LaunchConfig."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    return BACKEND


def close_rendezvous(endpoint: str, run_id: str, nodes: int) -> None:
    """Mark the job's rendezvous closed, so the other nodes' agents end at their next look instead of waiting
    ``--rdzv-timeout`` for this node to come back: what torch's agent does itself when its workers fail for good,
    and not when a signal stops it, as this node's did for a worker's refusal (``app.failures.refuse_job``). From a
    node that does not host the rendezvous (the host's end takes its store with it); a store already gone is left
    at that."""
    params = RendezvousParameters(BACKEND, endpoint, run_id, nodes, nodes, is_host=False, read_timeout=10)
    try:
        _create_handler(params).shutdown()
    except (RuntimeError, OSError, ValueError, dist.DistError):
        return
