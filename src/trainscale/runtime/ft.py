"""Per-step fault tolerance through torchft: the lighthouse, each replica's Manager, the start barrier and
the job's fault log. Only this module creates or destroys torchft's servers and process groups.

A fault-tolerant job (``--fault-tolerance``) is a set of replicas (one worker each), every one started
and restarted by its own torch elastic agent, so a dead replica's restart never touches the others. The
launcher hosts the lighthouse (torchft's quorum server) and a TCPStore for the start barrier, both on
127.0.0.1 (across machines, node 0's launcher on its rendezvous address). Each replica's Manager agrees on
the quorum with the lighthouse every step, reconfigures its gloo group when members leave or join, and heals a
replica that is behind by copying the live state from a peer over that same group (torchft's ``PGTransport``).

Where torchft falls short, and what is done here instead:
- its ManagerServer binds every interface (``[::]``) and advertises the host name; it is made to bind
  and advertise the replica's own address (``_manager_server_on``, MASTER_ADDR: the node's address toward
  node 0): single-machine jobs listen on 127.0.0.1 only, as every trainscale job does;
- its default HTTP checkpoint transport binds every interface too: ``PGTransport`` is used instead;
- its lighthouse reports its address by host name: the address is built from the bound port.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from trainscale.errors import ConfigError
from trainscale.io import dumps, open_regular
from trainscale.runtime.job import ADDRESS_ENV, BARRIER_ENV, EVENTS_ENV, OWNER_ENV, REPLICA_ENV, REPLICAS_ENV, this_job  # noqa: F401

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable (the launcher sets it, torchft reads it)
EVENTS_FILE = "ft-events.jsonl"
HEARTBEAT_S = 0.1


def torchft_available() -> bool:
    try:
        import_torchft()
    except ImportError:
        return False
    return True


def import_torchft() -> None:
    """Load torchft with its Rust servers' log level at warnings (unless RUST_LOG says otherwise): they log every
    quorum at info, and read RUST_LOG once, when the library loads, so it must be set before the first import."""
    os.environ.setdefault("RUST_LOG", "warn")
    import torchft  # noqa: F401


def require_torchft() -> None:
    if not torchft_available():
        raise ConfigError(
            "--fault-tolerance needs torchft (pip install torchft==0.2.0, as in constraints.txt); "
            "it is not installed in this environment"
        )


@contextlib.contextmanager
def lighthouse(host: str, heartbeat_timeout_s: float, port: int = 0) -> Iterator[str]:
    """torchft's lighthouse on ``host``:``port`` (0: a free one), quorums of at least one replica; yields its URL.
    A replica whose heartbeats stop for ``heartbeat_timeout_s`` leaves the next quorum; a live one that is late
    (it was sending its state to a healing peer) is waited for as long, or it would have to heal in turn, and the
    one that sends to it would be late next: with 100 ms a chaos run healed someone at every step."""
    import_torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{host}:{port}",
        min_replicas=1,
        join_timeout_ms=int(heartbeat_timeout_s * 1000),
        quorum_tick_ms=20,
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    try:
        yield f"http://{host}:{server.address().rsplit(':', 1)[1]}"
    finally:
        server.shutdown()


@contextlib.contextmanager
def barrier_store(host: str, port: int = 0) -> Iterator[str]:
    """A TCPStore on ``host``:``port`` (0: a free one) for the replicas' start barrier; yields ``host:port``."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True)
    try:
        yield f"{host}:{store.port}"
    finally:
        del store


def start_barrier(address: str | None, replicas: int, timeout_s: float) -> None:
    """Wait at ``address`` (the launcher's store) until all ``replicas`` have started, so the first quorum holds
    them all and step 1 is everyone's. A restarted replica, which joins the running job, passes None."""
    if not address:
        return
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    store.add("started", 1)
    deadline = time.monotonic() + timeout_s
    while int(store.add("started", 0)) < replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every replica started within {timeout_s:.0f} s")
        time.sleep(0.02)


@contextlib.contextmanager
def _manager_server_on(host: str) -> Iterator[None]:
    """torchft's Manager with its ManagerServer bound to ``host`` instead of every interface."""
    import torchft.manager as module

    original = module.ManagerServer

    def bound(**kwargs: Any) -> Any:
        return original(**{**kwargs, "bind": f"{host}:0", "hostname": host})

    module.ManagerServer = bound
    try:
        yield
    finally:
        module.ManagerServer = original


@contextlib.contextmanager
def manager(
    state: Callable[[], Any],
    load_state: Callable[[Any], None],
    timeout_s: float,
    quorum_timeout_s: float,
    device: torch.device,
    replica: int,
    master: tuple[str, int],
) -> Iterator[Any]:
    """Replica ``replica``'s torchft Manager (synchronous quorum every step, heals from a peer over its gloo
    group), on the replica's own store at ``master`` (its MASTER_ADDR, MASTER_PORT); always shut down."""
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    logging.getLogger("torchft").setLevel(logging.CRITICAL)  # its notices, and a traceback per failed step
    warnings.filterwarnings("ignore", module="torchft")
    host, port = master
    store = dist.TCPStore(host, port, 1, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=timeout_s)
    pg = ProcessGroupGloo(timeout=timeout)
    with _manager_server_on(host):
        ft = Manager(
            pg=pg,
            load_state_dict=load_state,
            state_dict=state,
            min_replica_size=1,
            use_async_quorum=False,
            replica_id=f"replica{replica}",
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=30),
            store_addr=host,
            store_port=port,
            hostname=host,
            rank=0,
            world_size=1,
            heartbeat_interval=timedelta(seconds=HEARTBEAT_S),
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
        )
    try:
        yield ft
    finally:
        ft.shutdown(wait=False)
        del store


def log_event(event: str, **fields: Any) -> None:
    """Append one event (its name, the time, this replica, ``fields``) to the job's fault log (``Job.fault_log``):
    one JSON line written with O_APPEND, so lines of concurrent replicas never interleave. A no-op outside such a
    job."""
    job = this_job()
    path = job.fault_log
    if path is None:
        return
    line = dumps({"event": event, "time": time.time(), "replica": job.replica, **fields}, indent=None)
    fd = open_regular(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def job_events() -> list[dict[str, Any]]:
    """The events of this process's job so far (none outside a job with a fault log)."""
    path = this_job().fault_log
    return read_events(path) if path else []


def job_finished() -> bool:
    """Whether some replica has already finished the job (its ``final`` event is in the fault log)."""
    return any(e["event"] == "final" for e in job_events())


def read_events(path: Path) -> list[dict[str, Any]]:
    """The fault log's events in time order (a torn last line, from a replica killed mid-write, skipped)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(events, key=lambda e: e["time"])


def _landed(value: Any) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


class QuorumTransport:
    """The collectives of this step's quorum, for trainscale's compression layer (``compression.collectives
    .Transport``): a compressed exchange under fault tolerance. A collective that fails (a member died or hung)
    is reported to the Manager, so the step is not committed, and yields its buffers as they are: the caller
    throws the result away. Both wait before returning (the exchange runs after the backward, nothing to hide)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def size(self) -> int:
        return max(1, self.manager.num_participants())

    def rank(self) -> int:
        return self.manager.participating_rank() or 0

    def all_reduce(self, flat: torch.Tensor) -> torch.futures.Future:
        self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        return _landed(flat)

    def all_gather(self, out: list[torch.Tensor], source: torch.Tensor) -> torch.futures.Future:
        """On failure every slot holds this replica's own ``source``: a payload its decoder can read (indices in
        range, sizes that fit), where the slots' memory would be garbage."""
        if self.manager.errored() is None:
            try:
                self.manager._pg.allgather([out], [source], AllgatherOptions()).wait()
                return _landed(out)
            except Exception as exc:  # a member left mid-collective: the step is aborted, not the run
                self.manager.report_error(exc)
        for slot in out:
            slot.copy_(source)
        return _landed(out)
