"""The RPC entry points a server process answers. RPC pickles functions by qualified name, so they
are module-level functions over this process's shard and coordinator (set by ``install``)."""

from __future__ import annotations

from typing import Any

import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from trainscale.modes.ps.coordinator import Coordinator
from trainscale.modes.ps.membership import Membership, WorkerDropped
from trainscale.modes.ps.server import Rule, ShardServer
from trainscale.modes.ps.stats import merge_server_stats
from trainscale.runtime.faults import InjectedFault
from trainscale.runtime.ft import log_event

_shard: ShardServer | None = None
_coordinator: Coordinator | None = None
_membership: Membership | None = None
_fault: InjectedFault | None = None  # --inject-fault kill:sN@P: this shard dies as its P-th push arrives
_pushes = 0  # every push this shard has received
_run_totals: dict[str, Any] = merge_server_stats([])


def install(
    shard: ShardServer, membership: Membership, coordinator: Coordinator | None, fault: InjectedFault | None = None
) -> None:
    global _shard, _coordinator, _membership, _fault, _pushes, _run_totals
    _shard, _coordinator, _membership, _fault, _pushes = shard, coordinator, membership, fault, 0
    _run_totals = merge_server_stats([])


def uninstall() -> None:
    install(None, None, None)  # type: ignore[arg-type]


def initialize(params: Tensor, rule: Rule) -> int:
    assert _shard is not None  # install() runs before RPC starts, uninstall() after it stops
    return _shard.initialize(params, rule)


def push(
    worker: int,
    epoch: int,
    step: int,
    payload: Any,
    lr: float,
    read_version: int,
    active: tuple[int, ...] | None,
    covers: tuple[tuple[int, int], ...] = (),
) -> int | WorkerDropped:
    """Apply or add the push; server 0 also records the batches it commits (``covers``, see handover.py)."""
    global _pushes
    assert _shard is not None and _membership is not None
    _pushes += 1
    if _fault is not None and _pushes >= _fault.step:
        _fault.fire(version=_shard.version)  # the updates since the last checkpoint are lost with it
    refusal = _membership.refusal(worker)  # a worker declared dead is turned away
    if refusal is not None:
        return refusal
    staleness = _shard.push(worker, epoch, step, payload, lr, read_version, active)
    if _coordinator is not None and covers:
        _coordinator.ledger.commit(epoch, covers)
    return staleness


@rpc.functions.async_execution
def pull(worker: int, epoch: int, step: int | None, active: tuple[int, ...] | None) -> Future:
    assert _shard is not None and _membership is not None
    refused = _membership.refused(worker)  # a worker declared dead is turned away
    return refused if refused is not None else _shard.pull(worker, epoch, step, active)


def state() -> dict[str, Any]:
    assert _shard is not None
    return _shard.state()


def load_state(value: dict[str, Any]) -> None:
    """A checkpoint's state (``--resume``, or the whole job restarted after a server's death)."""
    assert _shard is not None
    _shard.load_state(value)
    log_event("restored", shard=_shard.index, version=_shard.version)


def take_stats(epoch: int | None = None) -> dict[str, Any]:
    """The shard's counters; server 0 adds how many distinct batches of ``epoch`` pushes committed."""
    global _run_totals
    assert _shard is not None
    out = _shard.take_stats()
    if _coordinator is not None and epoch is not None:
        out["batches_committed"] = _coordinator.ledger.committed(epoch)
    _run_totals = merge_server_stats([_run_totals, out])
    return out


def run_totals() -> dict[str, Any]:
    """Every count ``take_stats`` has handed out so far: the run's, for whichever worker writes the summary."""
    return _run_totals


def leave(worker: int) -> None:
    assert _membership is not None
    _membership.mark_left(worker)


@rpc.functions.async_execution
def collective(worker: int, seq: int, op: str, value: Any, src: int | None) -> Future:
    assert _coordinator is not None  # collectives go to server 0, which has the coordinator
    return _coordinator.contribute(worker, seq, op, value, src)
