"""Grid keys ``cluster_hosts`` and ``bandwidth``: runs on emulated clusters that `trainscale bench` makes itself.

A run whose grid sets ``cluster_hosts = N`` and ``bandwidth = "100mbit"`` trains with ``--cluster bNh100mbit``;
the runner creates each distinct cluster once, before its first run, runs all of its runs together, and deletes
it after the last one (also when a run fails or the bench is interrupted). Either key may be an axis.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

from trainscale.cluster import owner as owners
from trainscale.cluster.command import BY_BENCH, BY_UP, bring_down, bring_up, recorded_elsewhere, state_path
from trainscale.errors import ConfigError
from trainscale.io import read_json
from trainscale.runtime import cluster as net

CLUSTER_KEYS = ("cluster_hosts", "bandwidth")
_NAME = re.compile(r"^b(\d+)h(\d+(?:bit|kbit|mbit|gbit))$")
LEFTOVER_GRACE_S = 20.0  # how long the runs of a killed bench may take to stop


def take_cluster_keys(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``cluster_hosts``/``bandwidth`` replaced by the ``cluster`` they name (ConfigError when
    only one is given, or with ``cluster`` itself)."""
    hosts, bandwidth = values.get("cluster_hosts"), values.get("bandwidth")
    rest = {k: v for k, v in values.items() if k not in CLUSTER_KEYS}
    if hosts is None and bandwidth is None:
        return rest
    if hosts is None or bandwidth is None:
        raise ConfigError("cluster_hosts and bandwidth go together: a grid run on an emulated cluster needs both")
    if rest.get("cluster") is not None:
        raise ConfigError(
            "give either cluster (one made with `trainscale cluster up`) or cluster_hosts and "
            "bandwidth (made by the bench), not both"
        )
    if not isinstance(hosts, int) or isinstance(hosts, bool):
        raise ConfigError(f"cluster_hosts must be an integer, got {hosts!r}")
    if not isinstance(bandwidth, str):
        raise ConfigError(f'bandwidth must be a rate like "100mbit", got {bandwidth!r}')
    return {**rest, "cluster": cluster_name(net.check_hosts(hosts), net.parse_rate(bandwidth))}


def cluster_name(hosts: int, rate: int) -> str:
    return f"b{hosts}h{net.format_rate(rate)}"


def bench_cluster(name: str | None) -> tuple[int, int] | None:
    """(hosts, rate) of a cluster the bench makes, None for any other (or none)."""
    match = _NAME.match(name or "")
    return (int(match.group(1)), net.parse_rate(match.group(2))) if match else None


@contextlib.contextmanager
def cluster_for(name: str | None) -> Iterator[None]:
    """Make the bench's cluster ``name`` for the body and delete it afterwards, owning it all along (its lock,
    ``cluster.owner``): another bench that needs the same cluster meanwhile is refused with one line, never
    handed this one. A leftover of a bench that is gone (killed) is replaced; a no-op for runs on no cluster or
    on one the user made."""
    shape = bench_cluster(name)
    if shape is None:
        yield
        return
    hosts, rate = shape
    assert name is not None  # a bench cluster has a name
    net.check_tools()
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(owners.owned(name))
    except owners.ClusterBusy as busy:
        raise ConfigError(
            f"cluster {name}, which this grid's runs need, is in use by {busy.owner}: wait for it to finish, or "
            f"stop it with `trainscale cluster down {name} --force`"
        ) from None
    with stack:
        _clear_leftover(name)
        bring_up(name, [rate] * hosts, by=BY_BENCH)
        try:
            yield
        finally:
            bring_down(name)


def _clear_leftover(name: str) -> None:
    """Delete what a bench that is gone left of cluster ``name`` (the caller owns it, so its maker is dead): its
    runs stop with it (the parent-death signal), so processes still in it are waited for a moment, then named.
    A cluster of this name made with `cluster up` is the user's: refused, never deleted."""
    if not (state_path(name).exists() or name in net.trainscale_namespaces()):
        return
    folder = recorded_elsewhere(name)
    if folder is not None and not state_path(name).exists():
        raise ConfigError(
            f"cluster {name}, which this grid's runs need, is recorded in another state folder, {folder}: remove it "
            f"there (TRAINSCALE_CLUSTER_STATE={folder} trainscale cluster down {name}), or name the grid's cluster "
            "otherwise"
        )
    record = read_json(state_path(name)) if state_path(name).exists() else {}
    if (record.get("owner") or {}).get("by") == BY_UP:
        raise ConfigError(
            f"cluster {name} was made with `trainscale cluster up`, but a bench makes and deletes the clusters it "
            f"names itself: remove it with `trainscale cluster down {name}`, or name it otherwise"
        )
    busy = net.residents(name, LEFTOVER_GRACE_S)
    if busy:
        raise ConfigError(
            f"cluster {name}, which this grid's runs need, is in use by another run (pid {busy[0]}: "
            f"{net.command_of(busy[0])}); wait for it, or stop it with `trainscale cluster down {name} --force`"
        )
    bring_down(name)
