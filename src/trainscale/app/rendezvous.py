"""Where the nodes of a job meet: the c10d rendezvous endpoint (node 0 hosts it; on one node a free port on
127.0.0.1), the run id, and the address this node's listeners bind to. The address checks themselves
(free, reachable) are ``runtime.network``'s; the store bound to one address is ``runtime.rendezvous``'s."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from trainscale.app.config import TrainConfig
from trainscale.runtime.network import (
    LOCALHOST,
    check_port_free,
    local_address_toward,
    parse_endpoint,
    wait_reachable,
)
from trainscale.runtime.rendezvous import held_endpoint

DEFAULT_MULTINODE_ID = "trainscale"


@contextlib.contextmanager
def rendezvous_address(cfg: TrainConfig) -> Iterator[tuple[str, bool]]:
    """(endpoint, is_host): node 0 hosts the c10d store, others must be able to reach it. On one machine, a port
    of 127.0.0.1 held for the store until the launch ends (``held_endpoint``)."""
    if cfg.launch.rdzv_endpoint is None:
        with held_endpoint(LOCALHOST) as endpoint:
            yield endpoint, True
        return
    host, port = parse_endpoint(cfg.launch.rdzv_endpoint)
    if cfg.launch.node_rank == 0:
        check_port_free(host, port)
        yield cfg.launch.rdzv_endpoint, True
        return
    wait_reachable(host, port, cfg.launch.rdzv_timeout)
    yield cfg.launch.rdzv_endpoint, False


def run_id(cfg: TrainConfig) -> str:
    """``--rdzv-id``; else one every node of a multi-node job agrees on without talking, or a fresh one."""
    return cfg.launch.rdzv_id or (DEFAULT_MULTINODE_ID if cfg.launch.nnodes > 1 else uuid.uuid4().hex)


def bind_address(endpoint: str, is_host: bool) -> str:
    """The address this node's listeners use: the rendezvous host on the node hosting it (127.0.0.1 on one
    machine), this machine's address toward it on the others. Node 0's workers meet at this address."""
    host, _ = parse_endpoint(endpoint)
    return host if is_host else local_address_toward(host)
