"""`trainscale cluster`: bring emulated clusters up and down, inspect them, cut or slow one host's link, probe.

Each cluster's configuration is kept as JSON in a state folder (``$TRAINSCALE_CLUSTER_STATE``, else
/run/trainscale/clusters: /run is a tmpfs, gone after a reboot just like the namespaces it describes), with the
process that made it (``owner``: pid, command, and whether `cluster up` or a bench made it). Making, deleting and
replacing a cluster happen under its lock (``cluster.owner``).

Namespaces are global to the machine while state folders are not, so each recorded cluster also leaves a pointer to
its state file in a fixed folder (``WHERE_DIR``, beside the locks): a command working with another state folder
then tells another folder's live cluster from debris, and never deletes it as debris.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from trainscale.cluster import owner as owners
from trainscale.console import format_table
from trainscale.errors import ConfigError
from trainscale.io import atomic_write_text, dumps, read_json
from trainscale.runtime import cluster as net

log = logging.getLogger("trainscale.cluster")

DEFAULT_STATE = "/run/trainscale/clusters"
WHERE_DIR = Path("/run/trainscale/where")  # cluster name -> the state file that records it, whatever the folder
PROBE_BYTES = 4_000_000
PROBE_PINGS = 50
PROBE_MAX_BYTES = 1 << 30  # 1 GiB: 86 s at 100 Mbit/s, inside the probe's 120 s
UP_PINGS = 20  # `up` measures the base round trip once (h0 -> h1) for runs to record
BY_UP, BY_BENCH = "cluster up", "bench"  # who made a cluster (its record's owner.by)


def state_dir() -> Path:
    return Path(os.environ.get("TRAINSCALE_CLUSTER_STATE", DEFAULT_STATE))


def state_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def where_path(name: str) -> Path:
    return WHERE_DIR / name


def recorded_elsewhere(name: str) -> Path | None:
    """The other state folder whose file records cluster ``name`` (made by a command with another
    ``$TRAINSCALE_CLUSTER_STATE``), or None: none does, or the record is this folder's."""
    pointer = where_path(name)
    if not pointer.is_file():
        return None
    with contextlib.suppress(OSError, ValueError):
        target = Path(pointer.read_text().strip())
        if target.is_absolute() and target != state_path(name).resolve() and target.is_file():
            return target.parent
    return None


def _elsewhere_hint(name: str, folder: Path) -> str:
    return (
        f"cluster {name} is recorded in another state folder, {folder}: use it with "
        f"TRAINSCALE_CLUSTER_STATE={folder} trainscale cluster ..."
    )


def load(name: str) -> dict:
    """The recorded configuration of cluster ``name``; an unknown name is a one-line error."""
    path = state_path(net.validate_name(name))
    if not path.exists():
        folder = recorded_elsewhere(name)
        if folder is not None:
            raise ConfigError(_elsewhere_hint(name, folder))
        raise ConfigError(f"no cluster named '{name}' (trainscale cluster status lists them)")
    return read_json(path)


def check_cluster(name: str) -> dict:
    """The cluster's record, once its namespaces are known to be there and no other process owns it now (the
    pre-flight of a run on it): a run on a cluster that an `up` is still making, a `down` deleting, or another
    bench using (it deletes it when done) would be cut off. A bench's own runs descend from their owner."""
    net.check_tools()
    holder = owners.holder(net.validate_name(name))
    if holder is not None and not owners.is_ancestor(holder.pid):
        raise ConfigError(
            f"cluster {name} is in use by {holder}, which is making, using or deleting it: wait for it to finish"
        )
    record = load(name)
    live = set(net.trainscale_namespaces().get(record["name"], []))
    gone = [ns for ns in record["namespaces"] if ns not in live]
    if gone:
        raise ConfigError(
            f"cluster '{name}' is recorded but {', '.join(gone)} is gone (a reboot?): "
            f"trainscale cluster down {name}, then up again"
        )
    return record


def save(record: dict) -> None:
    path = state_path(record["name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, dumps(record))
    WHERE_DIR.mkdir(parents=True, exist_ok=True)
    atomic_write_text(where_path(record["name"]), f"{path.resolve()}\n")


def _forget(name: str) -> None:
    """Remove cluster ``name``'s record and its pointer."""
    state_path(name).unlink(missing_ok=True)
    where_path(name).unlink(missing_ok=True)


def record_of(cluster: net.Cluster, by: str = BY_UP) -> dict:
    return {
        "name": cluster.name,
        "hosts": cluster.hosts,
        "switch": cluster.switch,
        "namespaces": [net.host_ns(cluster.name, i) for i in range(cluster.hosts)],
        "addresses": [net.address(i) for i in range(cluster.hosts)],
        "rates_bps": list(cluster.rates),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "owner": {"pid": os.getpid(), "command": net.command_of(os.getpid()), "by": by},
    }


def host_index(record: dict, text: str) -> int:
    """HOST is an index (``1``) or a namespace-style name (``h1``)."""
    digits = text[1:] if text.startswith("h") else text
    if not digits.isdigit() or int(digits) >= record["hosts"]:
        raise ConfigError(
            f"HOST must be 0-{record['hosts'] - 1} (or h0-h{record['hosts'] - 1}) for cluster "
            f"'{record['name']}', got '{text}'"
        )
    return int(digits)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    return format_table([dict(zip(headers, row)) for row in rows], [(h, h, str) for h in headers])


def up(args: argparse.Namespace) -> int:
    name = net.validate_name(args.name)
    if args.dilate_to:
        from trainscale.cluster.dilation import dilated_rates

        rates, dilation = dilated_rates(args.dilate_to, args.profile, args.hosts, args.bandwidth)
    else:
        if args.hosts is None or args.bandwidth is None:
            raise ConfigError("cluster up needs --hosts N and --bandwidth RATE (or --dilate-to CLUSTER --profile P)")
        rates, dilation = net.parse_rates(args.bandwidth, net.check_hosts(args.hosts)), None
    net.check_tools()  # root, before the lock folder is made
    with owners.owned(name):
        record = bring_up(name, rates, dilation)
    hosts = record["hosts"]
    print(
        f"cluster {name}: {hosts} hosts {net.address(0)}-{net.address(hosts - 1)} on switch {net.switch_ns(name)}, "
        f"round trip {record['rtt_seconds'] * 1e3:.3f} ms; run commands on a host with: "
        f"ip netns exec {net.host_ns(name, 0)} COMMAND"
    )
    if dilation:
        print(dilation["text"])
    return 0


def bring_up(name: str, rates: list[int], dilation: dict | None = None, by: str = BY_UP) -> dict:
    """Create cluster ``name`` (one host per rate), measure its round trip and record it (with the time
    dilation its rates carry, if any, and ``by``: who made it); returns the record. The caller owns the
    cluster (``owner.owned``). A record whose namespaces are all gone (a reboot, with a state folder that
    outlives one) is stale: it is removed, not collided with. Whatever fails or is interrupted, nothing of
    the new cluster is left."""
    cluster = net.Cluster(net.validate_name(name), tuple(rates))
    net.check_tools()
    owners.require(name)
    forget_stale(name)
    if state_path(name).exists():
        raise ConfigError(f"cluster '{name}' exists already (trainscale cluster down {name} removes it)")
    if name in net.trainscale_namespaces():
        folder = recorded_elsewhere(name)
        if folder is not None:
            raise ConfigError(_elsewhere_hint(name, folder))
        raise ConfigError(
            f"cluster '{name}' has namespaces but no record (an interrupted `cluster up`?): "
            f"trainscale cluster down {name} removes them"
        )
    try:
        net.create(cluster)
        record = record_of(cluster, by)
        if dilation:
            record["dilation"] = dilation
        record["rtt_seconds"] = net.measure(name, 0, 1, net.MIN_BURST_BYTES, UP_PINGS)["rtt_seconds"]
        save(record)
    except BaseException:
        net.destroy(name)
        raise
    return record


def forget_stale(name: str) -> bool:
    """Remove cluster ``name``'s record when none of its namespaces is left (its owner, who holds no lock, is
    gone too: the caller holds it); True when it did."""
    path = state_path(name)
    if not path.exists() or name in net.trainscale_namespaces():
        return False
    _forget(name)
    log.warning("cluster %s: its record was stale (no namespace of it is left, a reboot?); removed it", name)
    return True


def bring_down(name: str) -> list[str]:
    """Delete cluster ``name``'s namespaces and its state file; returns the namespaces removed. The caller owns
    the cluster (``owner.owned``)."""
    owners.require(name)
    removed = net.destroy(name)
    _forget(name)
    return removed


def down(args: argparse.Namespace) -> int:
    if args.all == bool(args.name):
        raise ConfigError("give either a cluster NAME or --all")
    net.check_tools()
    if args.all:
        names = sorted(set(net.trainscale_namespaces()) | net.leftover_cpu_groups() | {p.stem for p in _state_files()})
    else:
        names = [net.validate_name(args.name)]
    with contextlib.ExitStack() as stack:
        stopped = [owner for name in names if (owner := _own(stack, name, args.force))]
        if not args.all and stopped and not (_debris(args.name) or state_path(args.name).exists()):
            print(f"cluster {args.name}: stopped its owner, {stopped[0]}, which removed what it had made")
            return 0
        if not args.all:
            names = [args.name if _debris(args.name) else load(args.name)["name"]]
        in_use = {name: pids for name in names if (pids := net.residents(name))}
        if in_use and not args.force:
            name, pids = next(iter(in_use.items()))
            raise ConfigError(
                f"cluster {name} is in use by {len(pids)} process(es) of a run (pid {pids[0]}: "
                f"{net.command_of(pids[0])}); stop that run first, or stop it with `trainscale cluster down {name} "
                "--force`"
            )
        for pids in in_use.values():
            net.stop_processes(pids)
        for name in names:
            removed = bring_down(name)
            print(f"cluster {name}: removed {len(removed)} namespaces")
    if args.all:
        for name in owners.leftover_locks():  # lock files of killed owners
            owners.clear_leftover(name)
    return 0


def _own(stack: contextlib.ExitStack, name: str, force: bool) -> owners.Owner | None:
    """Take cluster ``name``'s lock for `down`: a live owner (a bench using it, an `up` making it) is named in one
    line, or with ``force`` stopped first (it then deletes what it made itself); returns the owner stopped."""
    try:
        stack.enter_context(owners.owned(name))
        return None
    except owners.ClusterBusy as busy:
        if not force:
            raise
        owners.stop_owner(busy.owner)
        stack.enter_context(owners.owned(name, wait_s=30.0))
        return busy.owner


def _debris(name: str) -> bool:
    """Namespaces or CPU groups of cluster ``name`` with no state file: what a `cluster up` killed (SIGKILL) before
    it recorded the cluster leaves; `down NAME` removes them as `down --all` does."""
    on_host = name in net.trainscale_namespaces() or name in net.leftover_cpu_groups()
    return on_host and not state_path(name).exists() and recorded_elsewhere(name) is None


def _state_files() -> list[Path]:
    return sorted(state_dir().glob("*.json")) if state_dir().is_dir() else []


def status(args: argparse.Namespace) -> int:
    net.check_tools()
    if args.name and not state_path(net.validate_name(args.name)).exists() and owners.holder(args.name):
        print(f"cluster {args.name}: being made by {owners.holder(args.name)}")
        return 0
    records = [load(args.name)] if args.name else [read_json(p) for p in _state_files()]
    live = net.trainscale_namespaces()
    rows = [row for record in records for row in _status_rows(record, live)]
    if rows:
        print(_table(["cluster", "namespace", "address", "rate", "link", "tx_bytes", "rx_bytes"], rows))
    elif not args.name:
        print("no clusters (trainscale cluster up NAME --hosts N --bandwidth RATE makes one)")
    for record in records:
        line = _owner_line(record)
        if line:
            print(line)
    debris = sorted((set(live) | net.leftover_cpu_groups()) - {r["name"] for r in records}) if not args.name else []
    for name, holder in [(n, owners.holder(n)) for n in debris]:
        if holder is not None:  # namespaces of a cluster a live owner is making: not debris
            print(f"cluster {name}: being made by {holder}")
            debris.remove(name)
        elif (folder := recorded_elsewhere(name)) is not None:  # another state folder's cluster: not debris
            print(f"cluster {name}: recorded in another state folder, {folder}")
            debris.remove(name)
    if debris:
        left = [ns for n in debris for ns in live.get(n) or [f"CPU groups of {n}"]]
        print(
            f"namespaces with no state file (debris): {', '.join(left)}; "
            f"remove them with: trainscale cluster down --all"
        )
    return 0


def _owner_line(record: dict) -> str | None:
    """Who holds the cluster now, or that the bench which made it is gone; None for a cluster made with `cluster up`
    and nobody changing it."""
    name, made = record["name"], record.get("owner") or {}
    holder = owners.holder(name)
    if holder is not None:
        done = ", which deletes it when it is done" if made.get("by") == BY_BENCH else ""
        return f"cluster {name}: in use by {holder}{done}"
    if made.get("by") == BY_BENCH:
        return (
            f"cluster {name}: left by a bench that is gone (pid {made.get('pid')}); the next bench that needs it "
            f"replaces it, `trainscale cluster down {name}` removes it"
        )
    return None


def _status_rows(record: dict, live: dict[str, list[str]]) -> list[list[str]]:
    rows = []
    for i in range(record["hosts"]):
        ns = net.host_ns(record["name"], i)
        if ns in live.get(record["name"], []):
            stats = net.host_stats(record["name"], i)
            state, tx, rx = stats.state, str(stats.tx_bytes), str(stats.rx_bytes)
        else:
            state, tx, rx = "missing", "-", "-"
        rows.append(
            [record["name"], ns, record["addresses"][i], net.format_rate(record["rates_bps"][i]), state, tx, rx]
        )
    return rows


def link(args: argparse.Namespace) -> int:
    if (args.state is None) == (args.bandwidth is None):
        raise ConfigError("give either up/down or --bandwidth RATE")
    net.check_tools()
    record = load(args.name)
    index = host_index(record, args.host)
    if args.state is not None:
        net.set_link(record["name"], index, args.state == "up")
        print(f"cluster {record['name']}: host {index} link {args.state}")
        return 0
    rate = net.parse_rate(args.bandwidth)
    net.set_rate(record["name"], index, rate)
    _update(record["name"], lambda r: r["rates_bps"].__setitem__(index, rate))
    print(f"cluster {record['name']}: host {index} rate {net.format_rate(rate)}")
    return 0


def probe(args: argparse.Namespace) -> int:
    if not 1 <= args.bytes <= PROBE_MAX_BYTES:
        raise ConfigError(f"--bytes {args.bytes}: give 1 to {PROBE_MAX_BYTES} bytes (default {PROBE_BYTES})")
    net.check_tools()
    record = load(args.name)
    down = [i for i in range(record["hosts"]) if net.host_stats(record["name"], i).state == "down"]
    if down:
        raise ConfigError(
            f"cluster {record['name']}: host {down[0]}'s link is down, so the probe cannot reach it; "
            f"`trainscale cluster link {record['name']} {down[0]} up` brings it back"
        )
    rows, rtts = [], []
    for dst in range(1, record["hosts"]):
        result = net.measure(record["name"], 0, dst, args.bytes, PROBE_PINGS)
        rtts.append(result["rtt_seconds"])
        rate = min(record["rates_bps"][0], record["rates_bps"][dst])
        rows.append(
            [
                f"h0 -> h{dst}",
                record["addresses"][dst],
                f"{result['rtt_seconds'] * 1e3:.3f}",
                f"{result['bits_per_second'] / 1e6:.1f}",
                f"{rate / 1e6:g}",
            ]
        )
    print(_table(["path", "address", "rtt_ms (median)", "measured_mbit", "configured_mbit"], rows))
    rtt = statistics.median(rtts)
    _update(record["name"], lambda r: r.__setitem__("rtt_seconds", rtt))
    return 0


def _update(name: str, change: Callable[[dict], None]) -> None:
    """Change cluster ``name``'s record as it is now on disk, if it is still there: a `down` (or a bench replacing
    the cluster) meanwhile must not have its record written back."""
    path = state_path(name)
    if not path.exists():
        log.warning("cluster %s was removed meanwhile; its record is not written back", name)
        return
    record = read_json(path)
    change(record)
    save(record)


def cluster_command(args: argparse.Namespace) -> int:
    handler = {"up": up, "down": down, "status": status, "link": link, "probe": probe}[args.cluster_command]
    return handler(args)


def add_cluster_parser(parser: argparse.ArgumentParser) -> None:
    """``trainscale cluster up|status|down|link|probe``."""
    sub = parser.add_subparsers(dest="cluster_command", required=True, parser_class=type(parser))
    p = sub.add_parser("up", help="create NAME: N host namespaces wired to a switch, each link shaped")
    p.add_argument("name")
    p.add_argument("--hosts", type=int, help=f"{net.MIN_HOSTS}-{net.MAX_HOSTS}")
    p.add_argument("--bandwidth", help="e.g. 1gbit, or one rate per host: 1gbit,1gbit,100mbit")
    p.add_argument(
        "--dilate-to",
        metavar="CLUSTER",
        help="emulate this cluster file's hosts and links (configs/"
        "clusters) slowed by this machine's step time over its device's, so compute and communication "
        "keep the target's ratio; runs on it report their times projected back to the target",
    )
    p.add_argument(
        "--profile",
        help="with --dilate-to: this machine's profile of the model to run, taken with the "
        "CPUs each emulated host gets (trainscale profile --cpus)",
    )
    p = sub.add_parser("status", help="hosts, addresses, rates, link states and byte counters")
    p.add_argument("name", nargs="?")
    p = sub.add_parser("down", help="delete NAME (or --all trainscale clusters and debris)")
    p.add_argument("name", nargs="?")
    p.add_argument("--all", action="store_true")
    p.add_argument(
        "--force",
        action="store_true",
        help="stop the cluster's owner (a bench using it, an `up` making it: SIGTERM, SIGKILL after 20 s) and the "
        "processes of a run still on it (SIGTERM, SIGKILL after 5 s) before deleting it",
    )
    p = sub.add_parser("link", help="cut/restore one host's link (down|up) or change its rate (--bandwidth)")
    p.add_argument("name")
    p.add_argument("host", help="host index (0..N-1) or h0..")
    p.add_argument("state", nargs="?", choices=["up", "down"])
    p.add_argument("--bandwidth")
    p = sub.add_parser("probe", help="latency and throughput from host 0 to every other host")
    p.add_argument("name")
    p.add_argument(
        "--bytes", type=int, default=PROBE_BYTES, help=f"bulk transfer size, 1 to {PROBE_MAX_BYTES} (default 4 MB)"
    )
