"""Device and cluster descriptions: small TOML files under ``configs/devices`` and ``configs/clusters``.

A device file gives measured throughput of a model at a batch size with its source (a results page or a
benchmark); a cluster file gives hosts, devices per host, the device, and the links inside and between
hosts (bandwidth and latency with their sources), and the scaling figures its page published. The
planner takes a device's compute from here when the cluster is not this machine; a name is looked up
as a path first, then in ``./configs/<kind>/`` and in the checkout's ``configs/<kind>/``.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscale.errors import ConfigError
from trainscale.io import read_toml
from trainscale.models import list_models
from trainscale.plan.costs import Link
from trainscale.plan.predict import MODES
from trainscale.runtime.cluster import parse_rate

FASTEST_LINK = 10_000_000_000_000  # 10 Tbit/s: above any NVLink generation
MAX_COUNT = 2**20  # hosts, devices, workers or images a plan may count: far beyond any cluster planned
_LATENCY_RE = re.compile(r"^(\d+(?:\.\d+)?)(ns|us|ms|s)$")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
CHECKOUT_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def parse_latency(text: str, flag: str = "--latency") -> float:
    """``50us``/``1ms``/``0.2s`` -> seconds (one way, per message)."""
    match = _LATENCY_RE.match(str(text).strip().lower())
    if not match:
        raise ConfigError(f"{flag} must look like 50us, 1ms or 0.2s, got '{text}'")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def parse_plan_rate(text: str, flag: str = "--bandwidth", high: int = FASTEST_LINK) -> int:
    """A planner's rate -> bit/s. tc's units (``25gbit``) and the spellings of data sheets: a lower-case b is
    bits (``25Gbps``, ``25Gb/s``, ``25Gbit/s``), an upper-case B bytes (``12GB/s``, ``12GBps``): the
    networking convention, so a rate copied from a NIC's or NVLink's spec sheet means what it says there."""
    return parse_rate(
        text,
        flag,
        high,
        bps=True,
        examples="such as 25gbit, 25Gbit/s or 25Gbps (b: bits, B: bytes, so 12GB/s = 96gbit)",
    )


def parse_link(bandwidth: str, latency: str = "0us", where: str = "--bandwidth") -> Link:
    """A link from rate text (bit/s; see :func:`parse_plan_rate`) and latency text; bytes/s and seconds inside."""
    bits = parse_plan_rate(str(bandwidth), flag=where)
    return Link(bits / 8.0, parse_latency(latency, flag=where.replace("bandwidth", "latency")))


@dataclass(frozen=True)
class Throughput:
    model: str
    batch_size: int
    images_per_sec: float
    precision: str
    source: str

    @property
    def step_seconds(self) -> float:
        return self.batch_size / self.images_per_sec


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    throughput: tuple[Throughput, ...] = ()

    def step_seconds(self, model: str, batch_size: int, precision: str = "fp32") -> tuple[float, Throughput]:
        """Seconds per step of ``model`` at ``batch_size`` per device in ``precision``, and the figure it rests
        on: the same batch, or the nearest one measured, scaled in proportion to the images (said in the plan).
        A figure in another precision is never used: bf16 or fp16 can be several times faster than fp32."""
        figures = [t for t in self.throughput if t.model == model]
        if not figures:
            have = ", ".join(sorted({t.model for t in self.throughput})) or "none"
            raise ConfigError(
                f"device {self.name} has no throughput for model {model} (it has: {have}); add a "
                f"[[throughput]] row to its file, or give {model}'s step time on it (--device-step-ms MS)"
            )
        same = [t for t in figures if t.precision == precision]
        if not same:
            have = ", ".join(sorted({t.precision for t in figures}))
            raise ConfigError(
                f"device {self.name} has {model} only in {have}, not {precision} (the profile's precision); "
                f"profile with --precision {figures[0].precision}, or add a {precision} [[throughput]] row"
            )
        figures = same
        best = min(figures, key=lambda t: (abs(t.batch_size - batch_size), -t.batch_size))
        return best.step_seconds * batch_size / best.batch_size, best


@dataclass(frozen=True)
class System:
    """What a cluster's software and wiring add to the links: NICs per host and the transport's achieved
    fraction of their line rate, the all-reduce algorithm, how much communication hides under backward, the
    framework's costs per bucket and per step, and the parameter servers' layout. ``assumed`` names the
    values no file gave (the plan says so)."""

    nics: int = 1
    transport: str = "tcp"
    algorithm: str | None = None
    overlap: float = 1.0
    bucket_overhead: float = 0.0
    step_overhead: float = 0.0
    servers: int | None = None
    placement: str = "colocated"
    assignment: str = "shard"
    efficiency: float = 1.0  # [link.inter]: the transport's achieved fraction of the NICs' line rate
    ps_efficiency: float = 1.0  # [system]: a parameter server's RPC stack's fraction of what the link carries
    host_images_per_sec: float | None = None  # [system]: what one host's CPUs and input pipeline deliver at most
    intra_efficiency: float = 1.0  # [link.intra]: the framework's achieved fraction of the devices' link
    assumed: tuple[str, ...] = (
        "overlap",
        "bucket_overhead",
        "step_overhead",
        "efficiency",
        "intra_efficiency",
        "ps_efficiency",
        "host_images_per_sec",
    )


TRANSPORTS = ("tcp", "rdma", "nvlink", "pcie")


def _fraction(table: _Table, key: str, default: float) -> float:
    value = table.get(key, float, default)
    if not 0 < value <= 1 and not (key == "overlap" and value == 0):
        raise ConfigError(f"{table.where(key)} must be a fraction in (0, 1], got {value}")
    return value


def _seconds(table: _Table, key: str) -> float:
    text = table.get(key, str, "0us")
    return parse_latency(text, table.where(key))


def _system(top: _Table, links: _Table) -> System:
    """The ``[system]`` table, the NIC keys of ``[link.inter]`` (``nics``, ``transport``, ``efficiency``) and
    ``[link.intra]``'s ``efficiency``."""
    inter = links.table("inter", "[link.inter]") or _Table(top.path, top.text, {}, "[link.inter]")
    intra = links.table("intra", "[link.intra]") or _Table(top.path, top.text, {}, "[link.intra]")
    table = top.table("system", "[system]") or _Table(top.path, top.text, {}, "[system]")
    transport = inter.get("transport", str, "tcp")
    if transport not in TRANSPORTS:
        raise ConfigError(f"{inter.where('transport')} is {transport!r}; give one of {', '.join(TRANSPORTS)}")
    algorithm = table.get("algorithm", str, None)
    if algorithm is not None and algorithm not in ("auto", "ring", "tree", "hierarchical"):
        raise ConfigError(f"{table.where('algorithm')} is {algorithm!r}; give auto, ring, tree or hierarchical")
    placement, assignment = table.get("ps_placement", str, "colocated"), table.get("ps_assignment", str, "shard")
    if placement not in ("colocated", "separate"):
        raise ConfigError(f"{table.where('ps_placement')} is {placement!r}; give colocated or separate")
    if assignment not in ("shard", "round_robin", "by_size"):
        raise ConfigError(f"{table.where('ps_assignment')} is {assignment!r}; give shard, round_robin or by_size")
    keys = ("overlap", "bucket_overhead", "step_overhead", "ps_efficiency", "host_images_per_sec")
    given: set[str] = {k for k in keys if k in table.raw}
    given |= {"efficiency"} if "efficiency" in inter.raw else set()
    given |= {"intra_efficiency"} if "efficiency" in intra.raw else set()
    return System(
        inter.get("nics", int, 1, positive=True),
        transport,
        algorithm,
        _fraction(table, "overlap", 1.0),
        _seconds(table, "bucket_overhead"),
        _seconds(table, "step_overhead"),
        table.get("ps_servers", int, None, positive=True),
        placement,
        assignment,
        _fraction(inter, "efficiency", 1.0),
        _fraction(table, "ps_efficiency", 1.0),
        table.get("host_images_per_sec", float, None, positive=True),
        _fraction(intra, "efficiency", 1.0),
        tuple(k for k in System().assumed if k not in given),
    )


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    description: str
    hosts: int
    devices_per_host: int
    device: str | None
    inter: Link | None
    intra: Link | None
    published: tuple[dict[str, Any], ...] = field(default=())
    source: str = ""
    system: System = field(default_factory=lambda: System())


def find_file(name: str, kind: str) -> Path:
    """``name`` as a path, else ``configs/<kind>/<name>.toml`` here or in the checkout."""
    direct = Path(name)
    if direct.suffix == ".toml" or direct.parent != Path("."):
        if direct.is_file():
            return direct
        if direct.exists():
            raise ConfigError(f"{kind[:-1]} file {name} is not a file; give a .toml file")
        raise ConfigError(f"{kind[:-1]} file {name} not found")
    for root in (Path("configs"), CHECKOUT_CONFIGS):
        if (root / kind / f"{name}.toml").is_file():
            return root / kind / f"{name}.toml"
    known = sorted(p.stem for p in (CHECKOUT_CONFIGS / kind).glob("*.toml"))
    raise ConfigError(f"unknown {kind[:-1]} {name!r}; known: {', '.join(known) or 'none'} (or give a .toml path)")


_HEADER_RE = re.compile(r"^\s*\[")
_NAMES = {str: "text", int: "a whole number", float: "a number", dict: "a table", list: "an array"}


@dataclass(frozen=True)
class _Table:
    """One table of a device or cluster file with where it is, so every problem is one line naming the file,
    the line (where TOML gives one: a key written as ``key = value`` under its header), the table and the key."""

    path: Path
    text: str
    raw: dict[str, Any]
    header: str = ""  # "[link.inter]", "[[published]]"; "" for the top level
    nth: int = 0  # which [[header]] of an array of tables

    def where(self, key: str | None = None) -> str:
        lines = self.text.splitlines()
        heads = [i for i, line in enumerate(lines) if line.strip().split("#")[0].strip() == self.header]
        start = (heads[self.nth] + 1) if self.header and self.nth < len(heads) else 0
        found = start if self.header and start else None
        for i in range(start, len(lines)):
            if _HEADER_RE.match(lines[i]):
                break
            if key is not None and re.match(rf"\s*{re.escape(key)}\s*=", lines[i]):
                found = i + 1
                break
        if key is not None and found in (None, start or None):  # a key that is a table has a header of its own
            inner = re.escape(f"{self.header.strip('[]')}.{key}" if self.header else key)
            found = next((i + 1 for i, x in enumerate(lines) if re.match(rf"\s*\[\[?{inner}\]", x)), found)
        table = f" {self.header}" + (f" #{self.nth + 1}" if self.header.startswith("[[") else "") if self.header else ""
        return f"{self.path}{f':{found}' if found else ''}:{table}" + (f" key {key!r}" if key else "")

    def get(self, key: str, kind: type, default: Any = ..., positive: bool = False) -> Any:
        """``key``'s value, of type ``kind`` (an int is a float too), finite and, with ``positive``, > 0;
        ``default`` when absent, else absence is an error."""
        if key not in self.raw:
            if default is ...:
                raise ConfigError(f"{self.where()} missing key {key!r}")
            return default
        value = self.raw[key]
        numeric = kind in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (
            numeric
            and (kind is float or isinstance(value, int))
            or kind not in (int, float)
            and isinstance(value, kind)
        ):
            raise ConfigError(f"{self.where(key)} must be {_NAMES[kind]}, got {ascii(value)[:60]}")
        if numeric and not (math.isfinite(value) and (value > 0 or not positive)):
            raise ConfigError(f"{self.where(key)} must be a {'positive' if positive else 'finite'} number, got {value}")
        if kind is int and numeric and value > MAX_COUNT:
            raise ConfigError(f"{self.where(key)} must be at most {MAX_COUNT}, got {value}")
        return float(value) if kind is float else value

    def only(self, known: tuple[str, ...]) -> _Table:
        """This table, refused if it holds a key none of ``known``: a misspelt key (``device_per_host``) would
        otherwise be dropped in silence and the plan made from the default."""
        for key in self.raw:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known here: {', '.join(known)}"
                raise ConfigError(f"{self.where(key)} is not one this table takes; {hint}")
        return self

    def table(self, key: str, header: str) -> _Table | None:
        value = self.get(key, dict, None)
        return None if value is None else _Table(self.path, self.text, value, header)

    def tables(self, key: str) -> list[_Table]:
        rows = self.get(key, list, [])
        if not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{self.where(key)} must be an array of tables ([[{key}]]), got {ascii(rows)[:60]}")
        return [_Table(self.path, self.text, r, f"[[{key}]]", i) for i, r in enumerate(rows)]


def _read(path: Path, kind: str) -> _Table:
    text, raw = read_toml(path, kind)
    return _Table(path, text, raw)


PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
DEVICE_KEYS = ("name", "description", "source", "peak_tflops_fp32", "memory_gbytes", "throughput")
THROUGHPUT_KEYS = ("model", "batch_size", "images_per_sec", "precision", "source")


def _precision(row: _Table) -> str:
    value = row.get("precision", str, "fp32")
    if value not in PRECISIONS:
        raise ConfigError(f"{row.where('precision')} is {value!r}; give one of {', '.join(PRECISIONS)}")
    return value


def load_device(name: str) -> Device:
    path = find_file(name, "devices")
    top = _read(path, "device file").only(DEVICE_KEYS)
    rows = [
        Throughput(
            t.get("model", str),
            t.get("batch_size", int, positive=True),
            t.get("images_per_sec", float, positive=True),
            _precision(t),
            t.get("source", str),
        )
        for t in (row.only(THROUGHPUT_KEYS) for row in top.tables("throughput"))
    ]
    return Device(top.get("name", str, path.stem), top.get("description", str, ""), tuple(rows))


def _link(table: _Table | None) -> Link | None:
    """A link table: ``bandwidth`` and ``latency``; inside a host, devices split over CPU sockets (``sockets``
    > 1) cross the sockets' link (``socket_bandwidth``, ``socket_latency``), which bounds a ring through them."""
    if table is None:
        return None
    bandwidth, latency = table.get("bandwidth", str), table.get("latency", str, "0us")
    link = parse_link(bandwidth, latency, table.where("bandwidth"))
    if table.get("sockets", int, 1, positive=True) > 1:
        hop = parse_link(
            table.get("socket_bandwidth", str), table.get("socket_latency", str, "0us"), table.where("socket_bandwidth")
        )
        link = Link(min(link.bandwidth, hop.bandwidth), link.latency + hop.latency)
    return link


PUBLISHED_NUMBERS = {"batch_size": int, "devices": int, "images_per_sec": float}  # required, > 0
PUBLISHED_OPTIONAL = {"hosts": int, "workers_per_host": int, "global_batch_size": int, "seconds_per_epoch": float}
PUBLISHED_KEYS = ("model", "mode", "source", *PUBLISHED_NUMBERS, *PUBLISHED_OPTIONAL, "utilisation")


def _published(row: _Table) -> dict[str, Any]:
    """One published figure, its numbers checked (> 0, whole where they count) and its hosts fitting its devices."""
    values = {
        **row.raw,
        "model": row.get("model", str),
        "mode": row.get("mode", str),
        "source": row.get("source", str, ""),
    }
    values.update({k: row.get(k, kind, positive=True) for k, kind in PUBLISHED_NUMBERS.items()})
    values.update({k: row.get(k, kind, None, positive=True) for k, kind in PUBLISHED_OPTIONAL.items() if k in row.raw})
    if values.get("hosts", 1) > values["devices"]:
        raise ConfigError(f"{row.where('hosts')} is {values['hosts']}, more than its {values['devices']} devices")
    if values["devices"] % values.get("hosts", 1):
        raise ConfigError(
            f"{row.where('devices')} is {values['devices']}, not a whole number of devices on each of its "
            f"{values['hosts']} hosts; give the devices and hosts the source used"
        )
    if values["mode"] not in MODES:
        raise ConfigError(f"{row.where('mode')} is {values['mode']!r}; the planner knows {', '.join(MODES)}")
    if values["model"] not in list_models():
        raise ConfigError(
            f"{row.where('model')} is {values['model']!r}, not a model trainscale knows "
            f"(trainscale models lists them); register it or drop the row"
        )
    return values


def _check_fits(row: _Table, values: dict[str, Any], hosts: int, per_host: int) -> None:
    """A published row is a run on (part of) this cluster: no more hosts, nor devices, than it has."""
    if values.get("hosts", 1) > hosts or values["devices"] > hosts * per_host:
        raise ConfigError(
            f"{row.where('devices')} is {values['devices']} devices on {values.get('hosts', 1)} host(s), more than "
            f"the cluster's {hosts} x {per_host}; raise the cluster's hosts or devices_per_host, or fix the row"
        )


def _device_of(top: _Table, path: Path) -> str | None:
    """The cluster's ``device``, found where its file points: a path is relative to the cluster file's folder,
    a name is looked up beside it (``../devices/<name>.toml``) before the usual places; a device that is not
    there is this file's error, on its line."""
    device = top.get("device", str, None)
    if device is None:
        return None
    given = Path(device)
    if given.suffix == ".toml" or given.parent != Path("."):
        found = given if given.is_absolute() else path.parent / given
        if not found.is_file():
            raise ConfigError(
                f"{top.where('device')} {device!r}: no such device file (paths are relative to {path.parent})"
            )
        return str(found)
    beside = path.parent.parent / "devices" / f"{device}.toml"
    if beside.is_file():
        return str(beside)
    try:
        find_file(device, "devices")
    except ConfigError as exc:
        raise ConfigError(f"{top.where('device')}: {exc}") from None
    return device


CLUSTER_KEYS = (
    *("name", "description", "source", "hosts", "devices_per_host", "device", "topology", "link", "system"),
    "published",
)
CLUSTER_TABLES = {
    "[link]": ("inter", "intra"),
    "[link.inter]": ("bandwidth", "latency", "source", "nics", "transport", "efficiency"),
    "[link.intra]": ("bandwidth", "latency", "source", "sockets", "socket_bandwidth", "socket_latency", "efficiency"),
    "[system]": (
        *("algorithm", "overlap", "bucket_overhead", "step_overhead", "ps_servers", "ps_placement"),
        *("ps_assignment", "ps_efficiency", "host_images_per_sec", "source"),
    ),
}
TOPOLOGIES = ("switch", "nvswitch", "nvlink", "pcie")  # a label for readers: the links' figures are what is planned


def _check_keys(top: _Table, links: _Table) -> None:
    """Every key of a cluster file is one the planner reads (or a label it checks): none dropped in silence."""
    top.only(CLUSTER_KEYS)
    tables = [links, links.table("inter", "[link.inter]"), links.table("intra", "[link.intra]")]
    for table in [*tables, top.table("system", "[system]")]:
        if table is not None:
            table.only(CLUSTER_TABLES[table.header])
    for row in top.tables("published"):
        row.only(PUBLISHED_KEYS)
    topology = top.get("topology", str, None)
    if topology is not None and topology not in TOPOLOGIES:
        raise ConfigError(
            f"{top.where('topology')} is {topology!r}; give one of {', '.join(TOPOLOGIES)} (a label: the plan's "
            "costs come from [link.intra] and [link.inter])"
        )


def load_cluster(name: str) -> ClusterSpec:
    path = find_file(name, "clusters")
    top = _read(path, "cluster file")
    links = top.table("link", "[link]") or _Table(path, top.text, {}, "[link]")
    _check_keys(top, links)
    device = _device_of(top, path)
    spec = ClusterSpec(
        top.get("name", str, path.stem),
        top.get("description", str, ""),
        top.get("hosts", int, positive=True),
        top.get("devices_per_host", int, 1, positive=True),
        device,
        _link(links.table("inter", "[link.inter]")),
        _link(links.table("intra", "[link.intra]")),
        tuple(_published(row) for row in top.tables("published")),
        top.get("source", str, ""),
        _system(top, links),
    )
    for row, values in zip(top.tables("published"), spec.published):
        _check_fits(row, values, spec.hosts, spec.devices_per_host)
    if spec.hosts > 1 and spec.inter is None:
        raise ConfigError(f"{path}: {spec.hosts} hosts need a [link.inter] with a bandwidth")
    if spec.devices_per_host > 1 and spec.intra is None:
        raise ConfigError(f"{path}: {spec.devices_per_host} devices per host need a [link.intra] with a bandwidth")
    return spec
