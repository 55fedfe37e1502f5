"""Emulated clusters on one machine: one Linux network namespace per host, all wired to a bridge that lives in
a switch namespace of its own, every link shaped in both directions with ``tc tbf``.

The ``*_argv`` / ``plan_*`` functions only build ``ip``/``tc`` command lines (unit-testable without root);
``create``/``destroy``/``set_link``/``set_rate`` run them. ``create`` tears down whatever it made when it fails
or is interrupted, so a half-built cluster never outlives the command.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainscale.errors import ConfigError, TrainscaleError
from trainscale.io import atomic_write_text
from trainscale.runtime.job import CLUSTER_ENV, this_job  # noqa: F401  (CLUSTER_ENV: `train --cluster` writes it)
from trainscale.runtime.orphans import is_running, sigterm_as_interrupt
from trainscale.stops import STOP_SIGNALS

log = logging.getLogger("trainscale.cluster")

PREFIX = "tsc-"
SUBNET = "10.77.0"  # one private /24, reused by every cluster: their namespaces have no route to each other
MIN_HOSTS, MAX_HOSTS = 2, 64
MAX_NAME = 16
BRIDGE = "br0"
HOST_DEV = "eth0"
MIN_RATE, MAX_RATE = 8_000, 100_000_000_000
# tbf must hold at least one kernel tick of tokens (rate/HZ) or it never reaches its rate; HZ is 100 at the
# least, so 10 ms of the rate works on every kernel. The floor keeps a few full-size frames in the bucket at
# low rates (GSO packets larger than the bucket are segmented by tbf itself).
BURST_SECONDS = 0.010
MIN_BURST_BYTES = 16 * 1024
QUEUE_LATENCY = "100ms"  # how long a packet may wait in the tbf queue before it is dropped
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` mounts /etc/netns/NS/hosts over /etc/hosts
CFS_PERIOD_US = 100_000
SETTLE_S = 1.0  # how long a process seen in a cluster may take to leave before it counts as a run on it

_NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9-]{{0,{MAX_NAME - 1}}}")  # fullmatch: no trailing newline
_NS_RE = re.compile(r"^tsc-(.+)-(sw|h\d+)$")
_OWN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]*$")
# A rate as tc writes it (``100mbit``) or as data sheets do (``25Gbit/s``, ``25Gb/s``, ``12GB/s``): a lower-case b
# is bits, an upper-case B bytes; ASCII digits only (float() would also read other scripts' digits).
_RATE_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)((?i:bits?(?:/s)?)|b/s|bps|B/s|Bps|(?i:bytes?/s))$")
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNITS = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}
RATE_EXAMPLES = "such as 100mbit, 1gbit or 1Gbit/s (b: bits, B: bytes, so 1GB/s = 8gbit)"


class CommandError(TrainscaleError):
    """An ``ip``/``tc`` command failed; the message names the command and its stderr on one line."""


def validate_name(name: str) -> str:
    """Cluster names become namespace, CPU group and /etc/netns folder names (``tsc-NAME-h63``: 24 characters at
    most): ASCII letters, digits and '-', at most 16 characters, nothing else (a newline or '/' would leave
    debris that neither ``status`` nor ``down`` can name)."""
    if not (isinstance(name, str) and _NAME_RE.fullmatch(name)):
        raise ConfigError(
            f"cluster name must be 1-{MAX_NAME} letters, digits or '-' (not starting with '-'), got {name!r}"
        )
    return name


def parse_rate(
    text: str, flag: str = "--bandwidth", high: int = MAX_RATE, bps: bool = False, examples: str = RATE_EXAMPLES
) -> int:
    """A rate's text -> bit/s, in tc's decimal units (``500kbit``, ``100mbit``, ``1gbit``) or a data sheet's
    (``1Gbit/s``, ``1Gb/s``, ``125MB/s``). ``bps`` (``1gbps``): bits as on a NIC's data sheet, where tc reads
    bytes; without ``bps`` (a shaped link, written as for tc) it is refused as the factor-8 mistake it often is.
    ``high``: the largest rate accepted (tc's for a shaped link; a planner's link, NVLink say, may be faster)."""
    match = _RATE_RE.match(str(text).strip())
    if not match:
        raise ConfigError(f"{flag} must be a rate in bits per second {examples}, got '{text}'")
    number, prefix, unit = match.groups()
    if unit.lower() == "bps" and not bps:
        raise ConfigError(
            f"{flag} {text.strip()}: tc reads bps as bytes per second, data sheets as bits; write "
            f"{number}{prefix.lower()}bit for bits or {number}{prefix.upper()}B/s for bytes"
        )
    in_bytes = unit in ("B/s", "Bps") or unit.lower().startswith("byte")
    bits = float(number) * _PREFIX[prefix.lower()] * (8 if in_bytes else 1)
    if not MIN_RATE <= bits <= high:
        raise ConfigError(f"{flag} must be between 8kbit and {format_rate(high)}, got '{text}'")
    return int(bits)


def parse_rates(text: str, hosts: int) -> list[int]:
    """One rate for every host, or a comma-separated rate per host."""
    parts = [p for p in text.split(",") if p.strip()]
    if len(parts) not in (1, hosts):
        raise ConfigError(f"--bandwidth takes one rate or {hosts} (one per host), got {len(parts)}: '{text}'")
    rates = [parse_rate(p) for p in parts]
    return rates * hosts if len(rates) == 1 else rates


def format_rate(bits: int) -> str:
    """bit/s -> the shortest exact tc-style text (``100mbit``)."""
    for unit in ("gbit", "mbit", "kbit"):
        if bits % _UNITS[unit] == 0:
            return f"{bits // _UNITS[unit]}{unit}"
    return f"{bits}bit"


def check_hosts(hosts: int) -> int:
    if not MIN_HOSTS <= hosts <= MAX_HOSTS:
        raise ConfigError(f"--hosts must be between {MIN_HOSTS} and {MAX_HOSTS}, got {hosts}")
    return hosts


@dataclass(frozen=True)
class Cluster:
    """What a cluster is made of; every name and address is derived from ``name`` and the host index."""

    name: str
    rates: tuple[int, ...]

    @property
    def hosts(self) -> int:
        return len(self.rates)

    @property
    def switch(self) -> str:
        return switch_ns(self.name)

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *(host_ns(self.name, i) for i in range(self.hosts))]


def switch_ns(name: str) -> str:
    return f"{PREFIX}{name}-sw"


def host_ns(name: str, index: int) -> str:
    return f"{PREFIX}{name}-h{index}"


def address(index: int) -> str:
    return f"{SUBNET}.{index + 1}"


def port_dev(index: int) -> str:
    """The switch-side end of host ``index``'s cable."""
    return f"p{index}"


def burst_bytes(rate: int) -> int:
    return max(int(rate / 8 * BURST_SECONDS), MIN_BURST_BYTES)


def shape_argv(ns: str, dev: str, rate: int) -> list[str]:
    """``tc qdisc replace`` so the same command both installs a shaper and changes its rate."""
    return [
        "tc",
        "-n",
        ns,
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{rate}bit",
        "burst",
        str(burst_bytes(rate)),
        "latency",
        QUEUE_LATENCY,
    ]


def plan_switch(cluster: Cluster) -> list[list[str]]:
    sw = cluster.switch
    return [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "set", "lo", "up"],
        ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "-n", sw, "link", "set", BRIDGE, "up"],
    ]


def plan_host(cluster: Cluster, index: int) -> list[list[str]]:
    """Namespace, cable (a veth created directly in both namespaces), address, and a shaper on each end."""
    ns, sw, port, rate = host_ns(cluster.name, index), cluster.switch, port_dev(index), cluster.rates[index]
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", HOST_DEV, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw],
        ["ip", "-n", sw, "link", "set", port, "master", BRIDGE],
        ["ip", "-n", sw, "link", "set", port, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{address(index)}/24", "dev", HOST_DEV],
        ["ip", "-n", ns, "link", "set", HOST_DEV, "up"],
        shape_argv(ns, HOST_DEV, rate),
        shape_argv(sw, port, rate),
    ]


def link_argv(name: str, index: int, up: bool) -> list[str]:
    """A partition pulls the cable at the switch: the host keeps its address but its eth0 loses carrier."""
    return ["ip", "-n", switch_ns(name), "link", "set", port_dev(index), "up" if up else "down"]


def rate_plan(name: str, index: int, rate: int) -> list[list[str]]:
    return [shape_argv(host_ns(name, index), HOST_DEV, rate), shape_argv(switch_ns(name), port_dev(index), rate)]


def run(argv: Sequence[str]) -> str:
    """Run one ``ip``/``tc`` command; a failure is one line naming the command and its stderr."""
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        detail = " ".join(proc.stderr.split()) or f"exit status {proc.returncode}"
        raise CommandError(f"'{' '.join(argv)}' failed: {detail}")
    return proc.stdout


def check_tools() -> None:
    """Creating namespaces and qdiscs needs root and iproute2's ``ip`` and ``tc``."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"trainscale cluster needs iproute2's {' and '.join(missing)} on PATH")
    if os.geteuid() != 0:
        raise ConfigError("trainscale cluster needs root (network namespaces and tc qdiscs): run it with sudo")


def list_namespaces() -> list[str]:
    """Every network namespace name (``ip netns list`` prints ``NAME (id: N)``)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def trainscale_namespaces() -> dict[str, list[str]]:
    """Namespaces trainscale made, by cluster name; nothing else is ever touched."""
    found: dict[str, list[str]] = {}
    for ns in list_namespaces():
        match = _NS_RE.match(ns)
        if match:
            found.setdefault(match.group(1), []).append(ns)
    return found


def processes_in(name: str) -> list[int]:
    """The processes living in cluster ``name``'s namespaces (a run on it): deleting the namespaces under them
    would cut their links and leave them waiting on each other."""
    pids: set[int] = set()
    for ns in trainscale_namespaces().get(name, []):
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        pids |= {int(p) for p in listed.split() if p.isdigit()}
    return sorted(pids)


def builders_of(name: str) -> list[int]:
    """Processes other than this one whose command line names one of cluster ``name``'s namespaces (``ip netns add
    tsc-NAME-h3``, ``tc -n tsc-NAME-sw ...``): commands that make, shape or query it. One that a `cluster up` killed
    a moment ago left running may still make a namespace, after a `down` that did not wait for it."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any((m := _NS_RE.match(arg)) and m.group(1) == name for arg in args):
            pids.append(int(cmdline.parent.name))
    return [pid for pid in pids if pid != os.getpid() and is_running(pid)]


def residents(name: str, settle_s: float = SETTLE_S) -> list[int]:
    """``processes_in`` and ``builders_of``, once none is left or ``settle_s`` has passed: a run lives in a cluster
    for minutes, an ``ip`` or ``tc`` command of a `cluster up` killed a moment ago for milliseconds more (a killed
    bench's runs for a few seconds)."""
    deadline = time.monotonic() + settle_s
    while (pids := sorted({*processes_in(name), *builders_of(name)})) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def command_of(pid: int) -> str:
    """Process ``pid``'s command line on one line, shortened, for a message ("" once it is gone)."""
    try:
        text = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
    except OSError:
        return ""
    return text if len(text) <= 80 else text[:77] + "..."


def stop_processes(pids: Sequence[int], grace_s: float = 5.0) -> None:
    """SIGTERM each process (an elastic agent then stops its workers), SIGKILL whatever is left after
    ``grace_s``; returns once all are gone."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def leftover_cpu_groups() -> set[str]:
    """Cluster names with a CPU group still in the cpu controller (a run killed before its teardown leaves
    them behind with no namespace): `cluster down --all` removes them too."""
    if not CGROUP_CPU.is_dir():
        return set()
    return {m.group(1) for g in CGROUP_CPU.glob(f"{PREFIX}*-h*") if (m := _NS_RE.match(g.name))}


@contextlib.contextmanager
def _shielded() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while tearing down, so the teardown itself always completes."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def destroy(name: str) -> list[str]:
    """Delete every namespace of cluster ``name`` (their veth ends and qdiscs go with them) and any CPU group a
    killed run left; returns the namespaces."""
    with _shielded():
        namespaces = trainscale_namespaces().get(name, [])
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        _remove_groups(_of(name, CGROUP_CPU.glob(f"{PREFIX}{name}-h*")) if CGROUP_CPU.is_dir() else [], wait_s=0)
        for folder in _of(name, NETNS_ETC.glob(f"{PREFIX}{name}-h*")):
            shutil.rmtree(folder, ignore_errors=True)
    return namespaces


def _of(name: str, paths: Iterator[Path]) -> list[Path]:
    """The paths of cluster ``name`` itself: ``tsc-a-h*`` also matches cluster ``a-h1``'s ``tsc-a-h1-h0``."""
    return sorted(p for p in paths if (m := _NS_RE.match(p.name)) and m.group(1) == name)


def hosts_text(cluster: Cluster, index: int, own_name: str | None = None) -> str:
    """Names for every host of the cluster (``h0``.., and the namespace name), as host ``index`` sees them.
    The c10d store looks up the name of each client, as the IPv4-mapped IPv6 address its dual-stack socket
    sees; with no name there the lookup goes to a DNS server the namespace cannot reach and every store logs a
    warning. The mapped addresses get names of their own, so a lookup of ``h0`` still returns only the IPv4
    address. ``own_name`` (this machine's host name, which every host shares) resolves to host ``index``'s
    own address, as a real machine's name does: torchrun's c10d rendezvous looks it up to decide whether a
    node hosts the store (its address is the endpoint's), and ``socket.getfqdn()`` maps it back to ``hI``,
    which every host resolves, for the workers' MASTER_ADDR."""
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    lines += [f"{address(i)} h{i} {host_ns(cluster.name, i)}" for i in range(cluster.hosts)]
    lines += [f"::ffff:{address(i)} h{i}.mapped" for i in range(cluster.hosts)]
    if own_name and _OWN_NAME_RE.match(own_name) and own_name not in " ".join(lines).split():
        lines.append(f"{address(index)} {own_name}")
    return "\n".join(lines) + "\n"


def write_hosts_file(cluster: Cluster, index: int) -> None:
    folder = NETNS_ETC / host_ns(cluster.name, index)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "hosts", hosts_text(cluster, index, socket.gethostname()))


def create(cluster: Cluster) -> None:
    """Build the cluster. Any failure, Ctrl-C or SIGTERM deletes what was made before it propagates."""
    if cluster.name in trainscale_namespaces():
        raise ConfigError(f"cluster '{cluster.name}' exists already (trainscale cluster status {cluster.name})")
    with sigterm_as_interrupt():
        try:
            for argv in plan_switch(cluster):
                run(argv)
            for index in range(cluster.hosts):
                for argv in plan_host(cluster, index):
                    run(argv)
                write_hosts_file(cluster, index)
        except BaseException:
            destroy(cluster.name)
            raise


def set_link(name: str, index: int, up: bool) -> None:
    run(link_argv(name, index, up))


def cut_link(name: str, index: int, seconds: float) -> None:
    """Take host ``index``'s cable out of the switch for ``seconds``, then back in. The restore runs in a
    process of its own session, so it happens even when whatever cut the link (a replica, say) dies
    meanwhile; when the cluster is gone by then, it fails without a word."""
    set_link(name, index, False)
    restore = "import subprocess, sys, time; time.sleep(float(sys.argv[1])); subprocess.run(sys.argv[2:])"
    subprocess.Popen(
        [sys.executable, "-c", restore, str(seconds), *link_argv(name, index, True)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def set_rate(name: str, index: int, rate: int) -> None:
    for argv in rate_plan(name, index, rate):
        run(argv)


@dataclass(frozen=True)
class HostStats:
    state: str
    tx_bytes: int
    rx_bytes: int


def host_stats(name: str, index: int) -> HostStats:
    """Link state of the host's cable (the switch port) and the bytes its eth0 has sent and received."""
    port = json.loads(run(["ip", "-j", "-n", switch_ns(name), "link", "show", "dev", port_dev(index)]))[0]
    dev = json.loads(run(["ip", "-j", "-s", "-n", host_ns(name, index), "link", "show", "dev", HOST_DEV]))[0]
    state = "up" if "UP" in port.get("flags", []) else "down"
    return HostStats(state, dev["stats64"]["tx"]["bytes"], dev["stats64"]["rx"]["bytes"])


def probe_helper() -> list[str]:
    """The probe helper runs by file path, a stdlib-only script that imports nothing of trainscale's."""
    return [sys.executable, str(Path(__file__).with_name("netprobe.py"))]


def in_namespace(name: str, index: int, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", host_ns(name, index), *argv]


def measure(name: str, src: int, dst: int, nbytes: int, pings: int, timeout: float = 120) -> dict:
    """Ping-pong latency and one-way TCP throughput from host ``src`` to host ``dst`` of cluster ``name``;
    only the cluster's own addresses are contacted."""
    server = subprocess.Popen(
        in_namespace(name, dst, [*probe_helper(), "serve", address(dst)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stderr is not None  # both piped above
    try:
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise CommandError(
                f"probe server in {host_ns(name, dst)} did not start: {' '.join(server.stderr.read().split())}"
            )
        client = subprocess.run(
            in_namespace(name, src, [*probe_helper(), "client", address(dst), port, str(nbytes), str(pings)]),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if client.returncode != 0:
            raise CommandError(
                f"probe {host_ns(name, src)} -> {address(dst)} failed: {' '.join(client.stderr.split()[-40:])}"
            )
        return json.loads(client.stdout)
    finally:
        server.kill()
        server.wait()


# ---------------------------------------------------------------------------------------- CPU shares


def cpu_group(name: str, index: int) -> Path:
    return CGROUP_CPU / f"{PREFIX}{name}-h{index}"


@contextlib.contextmanager
def cpu_quotas(name: str, hosts: int, cpus: float) -> Iterator[list[Path] | None]:
    """One cgroup-v1 cpu group per host, each capped at ``cpus`` CPUs (a CFS quota), removed afterwards.
    Real hosts do not lend each other cores while one waits on the network; without a cap an emulated host
    that waits hands its share to the others, and step times depend on who waits when. Yields None where
    the cpu controller is not mounted or not writable (the run goes on uncapped)."""
    groups = _make_groups(name, hosts, cpus)
    try:
        yield groups
    finally:
        _remove_groups(groups or [], wait_s=10.0)


def _make_groups(name: str, hosts: int, cpus: float) -> list[Path] | None:
    if not (CGROUP_CPU / "cgroup.procs").is_file():
        return None
    groups: list[Path] = []
    try:
        for index in range(hosts):
            group = cpu_group(name, index)
            group.mkdir(exist_ok=True)
            groups.append(group)
            (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(CFS_PERIOD_US * cpus))))
    except OSError as exc:
        log.warning("no CPU quota per host (%s): hosts share the cores freely", exc)
        _remove_groups(groups, wait_s=0)
        return None
    return groups


def join_cpu_group(group: Path) -> None:
    """Move this process (and so everything it starts) into ``group``; for a child's ``preexec_fn``."""
    (group / "cgroup.procs").write_text(str(os.getpid()))


@contextlib.contextmanager
def cpu_limited(cpus: float) -> Iterator[Path | None]:
    """This process under a quota of ``cpus`` CPUs for the body of the ``with`` (as an emulated host with
    that share runs), then back in the root group and the group removed. Yields None, uncapped, where
    the cpu controller is missing or not writable (a warning says so)."""
    groups = _make_groups(f"profile{os.getpid()}", 1, cpus)
    if groups:
        join_cpu_group(groups[0])
    try:
        yield groups[0] if groups else None
    finally:
        if groups:
            join_cpu_group(CGROUP_CPU)
            _remove_groups(groups, wait_s=2.0)


def _remove_groups(groups: list[Path], wait_s: float) -> None:
    """rmdir each group; a group empties only once its last process has exited, so retry up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    for group in groups:
        while True:
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    log.warning("CPU group %s still has processes; remove it with: rmdir %s", group, group)
                    break
                time.sleep(0.1)


# ---------------------------------------------------------------------------------------- runs on a cluster


def facts_from_env() -> dict | None:
    """What `train --cluster` told this job's processes about the cluster (None off a cluster): name, hosts,
    rates, measured round trip, the interface whose counters give the bytes on the wire, CPU share. Read from
    the environment once, at the process's entry (``runtime.job``)."""
    return this_job().cluster
