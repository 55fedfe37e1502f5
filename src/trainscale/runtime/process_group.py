"""The only place trainscale creates and destroys torch.distributed process groups.

Workers are started by torch.distributed.run (torchrun), which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; ``process_group()`` joins that group and always tears it down, so a
failing worker never leaves a half-open group behind. Every listener it opens is bound to MASTER_ADDR's
side of the network: the store through a socket bound here, gloo and TensorPipe through their interface
variables (see ``runtime.network``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from typing import TypedDict, Union

import torch
import torch.distributed as dist

from trainscale.errors import ConfigError
from trainscale.runtime.cluster import facts_from_env
from trainscale.runtime.dist import restart_count
from trainscale.runtime.network import interface_of, local_address_toward
from trainscale.runtime.rendezvous import bound_store

log = logging.getLogger("trainscale.runtime")

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 300.0
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")  # where gloo and TensorPipe listen
RPC_SCHEME = "trainscale"
PairRank = Union["dist.ProcessGroupGloo", "dist.ProcessGroupNCCL"]  # NCCL: only in CUDA builds


def launched_by_torchrun() -> bool:
    """True inside a worker started by torch.distributed.run (or anything setting the same variables)."""
    return all(v in os.environ for v in LAUNCH_VARS)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def worker_device(requested: torch.device) -> torch.device:
    """One GPU per worker: CUDA workers use ``cuda:LOCAL_RANK`` (after CUDA_VISIBLE_DEVICES)."""
    if requested.type != "cuda":
        return requested
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"local rank {index} has no GPU: only {torch.cuda.device_count()} visible; start at most one worker per GPU"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The elastic agent's shared store, seen under a prefix of this restart attempt; None otherwise.

    torch's agent (TORCHELASTIC_USE_AGENT_STORE=True, the default of the c10d rendezvous) keeps one TCP
    store across worker restarts, and the restarted workers' process group then finds the dead workers'
    keys (their gloo addresses, the init barrier's counters): connections refused or a hang in
    ``init_process_group``. A per-attempt prefix gives every attempt a clean key space. (On several
    nodes the agents' restart counts can differ, so `trainscale train` turns the sharing off instead:
    see ``app.worker_env``.)
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"trainscale/attempt_{restart_count()}", store)


def worker_store(timeout: datetime.timedelta, rank: int, world: int) -> dist.Store:
    """The store the workers meet in: the agent's shared one (an external torchrun's default), or one that
    rank 0 serves on MASTER_ADDR only (torch's env:// store would listen on every interface)."""
    shared = attempt_store(timeout)
    if shared is not None:
        return shared
    return bound_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank == 0, timeout, world)


def bind_interfaces() -> None:
    """Point gloo and TensorPipe at the interface this worker reaches MASTER_ADDR through (``lo`` on one
    machine), unless the user chose one; left alone, they bind the address the host name resolves to."""
    if all(name in os.environ for name in INTERFACE_VARS):
        return
    interface = interface_of(local_address_toward(os.environ["MASTER_ADDR"]))
    for name in INTERFACE_VARS:
        os.environ.setdefault(name, interface)


def _rpc_rendezvous(
    url: str, timeout: datetime.timedelta = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S), **_: object
) -> Iterator[tuple[dist.Store, int, int]]:
    """torch.distributed.rendezvous handler for RPC: ``worker_store`` under the rank and world RPC asks for."""
    query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
    rank, world = int(query["rank"][0]), int(query["world_size"][0])
    yield worker_store(timeout, rank, world), rank, world
    raise RuntimeError("trainscale's RPC rendezvous runs once per process")


def register_rpc_rendezvous() -> str:
    """Make ``RPC_SCHEME://`` an init_method of torch.distributed.rpc (idempotent); returns the URL."""
    try:
        dist.register_rendezvous_handler(RPC_SCHEME, _rpc_rendezvous)
    except RuntimeError:  # registered earlier in this process
        pass
    return f"{RPC_SCHEME}://"


@contextlib.contextmanager
def process_group(
    device: torch.device, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Iterator[str]:
    """Join the launcher's process group for the body of the ``with``; yields the backend name.

    ``timeout_s`` bounds every collective, so a dead peer ends the job with an error instead of a hang.
    Without launcher variables this is a no-op (world of 1), so callers need no branch.

    Leaving the ``with`` must really free the group: one that outlives ``destroy_process_group`` is freed
    at interpreter exit, where gloo's threads can abort the finished worker (SIGABRT, "terminate called
    without an active exception"), one run in four on a loaded machine. Two things keep it alive: garbage
    in reference cycles (DDP wrappers and their comm hooks), collected before the group is destroyed, and
    torch._dynamo when it is first imported while a group exists (the first optimizer step imports it;
    torch 2.13 then holds the group for good), so it is imported before the group is made.
    """
    if not launched_by_torchrun() or dist.is_initialized():
        yield backend or default_backend(device)
        return
    backend = backend or default_backend(device)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("--backend nccl needs CUDA devices; use gloo on the CPU")
    device_id = device if backend == "nccl" else None
    timeout = datetime.timedelta(seconds=timeout_s)
    bind_interfaces()
    importlib.import_module("torch._dynamo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        store=worker_store(timeout, rank, world),
        rank=rank,
        world_size=world,
        device_id=device_id,
    )
    log.debug("joined process group: backend %s, rank %d of %d", backend, dist.get_rank(), dist.get_world_size())
    try:
        yield backend
    finally:
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def local_group() -> Iterator[None]:
    """A gloo group of this process alone (an in-memory store, no sockets), for measuring what DDP does
    (its buckets, when each becomes ready) outside a launched job; always destroyed on leaving."""
    if dist.is_initialized():
        raise RuntimeError("local_group() inside an existing process group: measure outside the job")
    importlib.import_module("torch._dynamo")  # see process_group(): imported before the group exists
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()


class PairError(RuntimeError):
    """Two ranks of this process could not form a group (NCCL or gloo refused, or timed out)."""


def _pair_rank(store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> PairRank:
    """Rank ``rank`` of a two-rank group on ``device``: NCCL on a GPU (the calling thread's device set to it
    first, as NCCL's ranks in one process need), gloo over 127.0.0.1 on the CPU."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, nccl)
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    gloo._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, gloo)


@contextlib.contextmanager
def loopback_pair(
    devices: tuple[torch.device, torch.device] = (torch.device("cpu"), torch.device("cpu")), timeout_s: float = 60.0
) -> Iterator[tuple[PairRank, PairRank]]:
    """Two ranks inside this process, joined through an in-memory store, for measuring a collective beside this
    process's own work (the profile's overlap) without launching a second process: gloo over 127.0.0.1 on the
    CPU, NCCL between two GPUs (``devices``: rank 0's and rank 1's; NCCL takes one rank per GPU). Each rank's
    calls must come from its own thread, on its own device; both groups are shut down on leaving."""
    cuda = [d.type == "cuda" for d in devices]
    if cuda[0] != cuda[1] or (cuda[0] and devices[0] == devices[1]):
        raise ValueError(f"a pair needs two CPU ranks or two different GPUs, got {devices[0]} and {devices[1]}")
    store = dist.HashStore()
    groups: list[PairRank | None] = [None, None]

    def join(rank: int) -> None:
        groups[rank] = _pair_rank(store, rank, devices[rank], timeout_s)

    def leave(rank: int) -> None:
        group = groups[rank]
        if group is not None:
            group.shutdown()

    errors = _each_rank(join, timeout_s)
    try:
        if errors or None in groups:
            raise PairError(str(errors[0]) if errors else f"not formed within {timeout_s:g} s")
        yield groups[0], groups[1]  # type: ignore[misc]
    finally:
        for exc in _each_rank(leave, timeout_s):
            log.warning("a loopback pair's rank did not shut down cleanly: %s", exc)


def _each_rank(call: Callable[[int], None], timeout_s: float) -> list[BaseException]:
    """``call(0)`` and ``call(1)`` at once, each on its own thread, as a pair's ranks must form and leave (NCCL
    forms a communicator and destroys it as a collective of its ranks); the errors they raised."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            call(rank)
        except BaseException as exc:  # reported on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return errors


class TensorPipeOptions(TypedDict):
    """The keywords of ``TensorPipeRpcBackendOptions`` that ``tensorpipe_options`` sets."""

    _transports: list[str]
    _channels: list[str]


def tensorpipe_options() -> TensorPipeOptions:
    """TensorPipe's transports and channels for trainscale's RPC (every tensor it sends is on the CPU).

    Never the shared-memory transport (``shm``), TensorPipe's default between processes of one machine:
    its reactor thread (``TP_SHM_reactor``) busy-polls a whole core in every process, beside workers that
    were given every core, and a 1-worker, 1-server run took 22x as long per epoch as training alone.
    TCP (``uv``, driven by epoll) instead. On one machine tensors then move by cross-memory attach
    (``cma``: one copy, a thread that sleeps when idle), or over the connection (``basic``) where the
    kernel forbids it. On an emulated cluster the hosts are one machine too, but every byte must cross
    the shaped links and their interface counters: ``basic`` only."""
    return {"_transports": ["uv"], "_channels": ["basic"] if facts_from_env() else ["cma", "basic"]}


@contextlib.contextmanager
def rpc_session(name: str, rank: int, world_size: int, timeout_s: float, threads: int = 16) -> Iterator[None]:
    """The only place trainscale starts and stops torch.distributed.rpc (parameter-server modes).

    Every process of the job joins under a unique ``name`` through the launcher's MASTER_ADDR/PORT store.
    ``timeout_s`` is the default RPC timeout, so a hung peer becomes an error. Shutdown is always local
    (``graceful=False``): a graceful one waits for every process, dead ones included, and the PS has its
    own handshake (workers tell the servers they are leaving) before anyone gets here.
    """
    import warnings

    import torch.distributed.rpc as rpc

    bind_interfaces()
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=threads, rpc_timeout=timeout_s, init_method=register_rpc_rendezvous(), **tensorpipe_options()
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="torch.distributed")  # RPC's maintenance-mode notice
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    log.debug("joined RPC as %s (rank %d of %d)", name, rank, world_size)
    try:
        yield
    finally:
        rpc.shutdown(graceful=False)
