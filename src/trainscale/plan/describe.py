"""Device and cluster descriptions: small TOML files under ``configs/devices`` and ``configs/clusters``.

A device file gives measured throughput of a model at a batch size with its source (a results page or a
benchmark); a cluster file gives hosts, devices per host, the device, and the links inside and between
hosts (bandwidth and latency with their sources), and the scaling figures its page published. The
planner takes a device's compute from here when the cluster is not this machine; a name is looked up
as a path first, then in ``./configs/<kind>/`` and in the checkout's ``configs/<kind>/``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscale.errors import ConfigError
from trainscale.io import read_toml
from trainscale.plan.costs import Link
from trainscale.runtime.cluster import parse_rate

FASTEST_LINK = 10_000_000_000_000  # 10 Tbit/s: above any NVLink generation
_LATENCY_RE = re.compile(r"^(\d+(?:\.\d+)?)(ns|us|ms|s)$")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
CHECKOUT_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def parse_latency(text: str, flag: str = "--latency") -> float:
    """``50us``/``1ms``/``0.2s`` -> seconds (one way, per message)."""
    match = _LATENCY_RE.match(str(text).strip().lower())
    if not match:
        raise ConfigError(f"{flag} must look like 50us, 1ms or 0.2s, got '{text}'")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def parse_link(bandwidth: str, latency: str = "0us", where: str = "--bandwidth") -> Link:
    """A link from rate text (bit/s, tc's units) and latency text; bytes/s and seconds inside."""
    bits = parse_rate(str(bandwidth), flag=where, high=FASTEST_LINK)
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

    def step_seconds(self, model: str, batch_size: int) -> tuple[float, Throughput]:
        """Seconds per step of ``model`` at ``batch_size`` per device, and the figure it rests on: the same
        batch, or the nearest one measured, scaled in proportion to the images (said in the plan)."""
        figures = [t for t in self.throughput if t.model == model]
        if not figures:
            have = ", ".join(sorted({t.model for t in self.throughput})) or "none"
            raise ConfigError(f"device {self.name} has no throughput for model {model} (it has: {have}); add a "
                              f"[[throughput]] to its file or plan with this machine's profile (no --device)")
        best = min(figures, key=lambda t: (abs(t.batch_size - batch_size), -t.batch_size))
        return best.step_seconds * batch_size / best.batch_size, best


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


def find_file(name: str, kind: str) -> Path:
    """``name`` as a path, else ``configs/<kind>/<name>.toml`` here or in the checkout."""
    direct = Path(name)
    if direct.suffix == ".toml" or direct.parent != Path("."):
        if direct.is_file():
            return direct
        raise ConfigError(f"{kind[:-1]} file {name} not found")
    for root in (Path("configs"), CHECKOUT_CONFIGS):
        if (root / kind / f"{name}.toml").is_file():
            return root / kind / f"{name}.toml"
    known = sorted(p.stem for p in (CHECKOUT_CONFIGS / kind).glob("*.toml"))
    raise ConfigError(f"unknown {kind[:-1]} {name!r}; known: {', '.join(known) or 'none'} (or give a .toml path)")


def _require(raw: dict[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise ConfigError(f"{where}: missing key {key!r}")
    return raw[key]


def _positive(value: Any, what: str) -> Any:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{what} must be a positive number, got {value!r}")
    return value


def load_device(name: str) -> Device:
    path = find_file(name, "devices")
    _, raw = read_toml(path, "device file")
    rows = []
    for i, t in enumerate(raw.get("throughput", [])):
        where = f"{path} [[throughput]] #{i + 1}"
        rows.append(Throughput(str(_require(t, "model", where)), int(_positive(_require(t, "batch_size", where),
                                                                                  f"{where} batch_size")),
                               float(_positive(_require(t, "images_per_sec", where), f"{where} images_per_sec")),
                               str(t.get("precision", "fp32")), str(_require(t, "source", where))))
    return Device(str(raw.get("name", path.stem)), str(raw.get("description", "")), tuple(rows))


def _link(raw: dict[str, Any] | None, where: str) -> Link | None:
    if raw is None:
        return None
    return parse_link(str(_require(raw, "bandwidth", where)), str(raw.get("latency", "0us")), f"{where} bandwidth")


def load_cluster(name: str) -> ClusterSpec:
    path = find_file(name, "clusters")
    _, raw = read_toml(path, "cluster file")
    links = raw.get("link", {})
    spec = ClusterSpec(str(raw.get("name", path.stem)), str(raw.get("description", "")),
                       int(_positive(_require(raw, "hosts", str(path)), f"{path}: hosts")),
                       int(_positive(raw.get("devices_per_host", 1), f"{path}: devices_per_host")),
                       raw.get("device"), _link(links.get("inter"), f"{path} [link.inter]"),
                       _link(links.get("intra"), f"{path} [link.intra]"), tuple(raw.get("published", [])),
                       str(raw.get("source", "")))
    if spec.hosts > 1 and spec.inter is None:
        raise ConfigError(f"{path}: {spec.hosts} hosts need a [link.inter] with a bandwidth")
    if spec.devices_per_host > 1 and spec.intra is None:
        raise ConfigError(f"{path}: {spec.devices_per_host} devices per host need a [link.intra] with a bandwidth")
    return spec
