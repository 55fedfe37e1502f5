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

from trainscale.cluster.command import bring_down, bring_up, state_path
from trainscale.errors import ConfigError
from trainscale.runtime import cluster as net

CLUSTER_KEYS = ("cluster_hosts", "bandwidth")
_NAME = re.compile(r"^b(\d+)h(\d+(?:bit|kbit|mbit|gbit))$")


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
    """Make the bench's cluster ``name`` for the body (a leftover of an interrupted bench is replaced) and
    delete it afterwards; a no-op for runs on no cluster or on one the user made."""
    shape = bench_cluster(name)
    if shape is None:
        yield
        return
    hosts, rate = shape
    assert name is not None  # a bench cluster has a name
    if state_path(name).exists() or name in net.trainscale_namespaces():
        busy = net.processes_in(name)
        if busy:
            raise ConfigError(
                f"cluster {name}, which this grid's runs need, is in use by another run (pid {busy[0]}: "
                f"{net.command_of(busy[0])}); wait for it, or stop it with `trainscale cluster down {name} --force`"
            )
        bring_down(name)
    bring_up(name, [rate] * hosts)
    try:
        yield
    finally:
        bring_down(name)
