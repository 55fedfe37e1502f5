"""The planner's model of one training step on a cluster, from a measured profile and link figures.

Sync (DDP): each gradient bucket's collective starts when the bucket is ready (profiled) and after the
previous one; what ends after backward is exposed, the rest is hidden. Layer-wise compressors code each
bucket inside its hook, on the backward thread (encode delays the rest of backward), and decode when
its collective lands; entire-model ones code once after backward, with nothing to overlap. All-gather
methods decode every worker's payload. The parameter server (push, then pull, after backward) is bound
by the host links that carry the shards' traffic (pushes carry the compressor's payload, encoded by the worker
and decoded by the servers; pulls the fp32 parameters); asynchronous workers also share their host's link
with the server's replies to the other hosts, which a processor-sharing queue models: with o seconds of
others' traffic per step, step = c + own x step / (step - o). Local SGD and DiLoCo exchange the model
every H steps. Everything is per worker and per step; the device's compute is this machine's (the
profile) times ``compute_scale`` when the plan is for another device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from trainscale.errors import ConfigError
from trainscale.plan.costs import (
    ALGORITHMS,
    ASSIGNMENTS,
    Fabric,
    Link,
    allreduce,
    collective,
    colocated_parameter_server,
    overlapped_finish,
    parameter_server,
    placed_parameter_server,
    server_loads,
)
from trainscale.plan.methods import DENSE, MethodSpec
from trainscale.plan.profile import Profile

MODES = ("sync", "ps-sync", "async", "localsgd", "diloco")


@dataclass(frozen=True)
class PSLayout:
    """How a parameter-server system places its servers and tensors: ``colocated`` (a server beside the
    workers of every host, ``--servers`` per host) or ``separate`` (``--servers`` hosts of their own, each
    with the cluster's NICs); ``assignment`` of tensors (shard, round_robin, by_size); ``efficiency``: the
    transport's achieved fraction of line rate."""

    placement: str = "colocated"
    assignment: str = "shard"
    efficiency: float = 1.0
    total: int | None = None  # colocated: servers in all, one on each of the first hosts (default: all hosts)

    def __post_init__(self) -> None:
        if self.placement not in ("colocated", "separate"):
            raise ConfigError(f"parameter-server placement {self.placement!r}: colocated or separate")
        if self.assignment not in ASSIGNMENTS:
            raise ConfigError(f"parameter-server assignment {self.assignment!r}: {', '.join(ASSIGNMENTS)}")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(
                f"parameter-server efficiency is a fraction of line rate in (0, 1], got {self.efficiency}"
            )


@dataclass(frozen=True)
class Setting:
    """Where and how to train: hosts x workers per host, their links, the mode and the compressor."""

    hosts: int
    per_host: int
    inter: Link | None
    intra: Link | None
    mode: str = "sync"
    spec: MethodSpec = MethodSpec(DENSE)
    sync_every: int = 1
    servers: int = 1
    compute_scale: float = 1.0
    batch_size: int | None = None  # per worker; None: the profile's
    grad_scale: float = 1.0  # bytes of a communicated gradient over fp32's (bf16/fp16: 0.5)
    accumulate: int = 1  # micro-steps per optimizer step (one communication per optimizer step)
    algorithm: str = "ring"  # all-reduce: ring (gloo's), tree, hierarchical, or auto (as NCCL picks)
    nics: int = 1  # network interfaces per host
    overlap: float = 1.0  # fraction of in-flight communication that can hide under backward
    bucket_overhead: float = 0.0  # seconds the framework adds to every bucket's collective
    step_overhead: float = 0.0  # seconds the framework adds to every synchronised step
    ps: PSLayout = PSLayout()
    host_images_per_sec: float | None = None  # what a host's CPUs and input pipeline feed its devices at most
    efficiency: float = 1.0  # the transport's achieved fraction of the line rate between hosts (``inter``)
    step_share: float = 0.0  # the framework's cost per synchronised step as a share of one device's step
    intra_efficiency: float = 1.0  # the framework's achieved fraction of the devices' link inside a host (``intra``)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--mode {self.mode!r}: the planner knows {', '.join(MODES)}")
        if self.hosts < 1 or self.per_host < 1:
            raise ConfigError(f"hosts and workers per host must be at least 1, got {self.hosts} x {self.per_host}")
        if self.hosts > 1 and self.inter is None:
            raise ConfigError("several hosts need a bandwidth between them (--bandwidth)")
        if self.sync_every < 1 or self.servers < 1 or self.accumulate < 1 or self.nics < 1:
            raise ConfigError("--sync-every, --servers, --accumulate and NICs per host must be at least 1")
        if self.algorithm not in ("auto", *ALGORITHMS):
            raise ConfigError(f"--algorithm {self.algorithm!r}: auto, {', '.join(ALGORITHMS)}")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"--overlap is a fraction in [0, 1], got {self.overlap}")
        if self.host_images_per_sec is not None and not self.host_images_per_sec > 0:
            raise ConfigError(f"--host-images-per-sec must be positive, got {self.host_images_per_sec}")
        if self.bucket_overhead < 0 or self.step_overhead < 0 or not 0 <= self.step_share < 1:
            raise ConfigError("framework overheads cannot be negative (and a share of the step is below 1)")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"--efficiency is a fraction of line rate in (0, 1], got {self.efficiency}")
        if not 0 < self.intra_efficiency <= 1:
            raise ConfigError(f"--intra-efficiency is a fraction of line rate in (0, 1], got {self.intra_efficiency}")

    @property
    def workers(self) -> int:
        return self.hosts * self.per_host

    def framework_costs(self) -> dict[str, Any]:
        """What the plan charged beside the device's step and the wire, as numbers (``plan --json``'s
        ``framework``): the overlap, the costs per step and per bucket (seconds), the host's input ceiling, and the
        rate charged between hosts (bit/s: the line rate times the transport's efficiency)."""
        return {
            "overlap": self.overlap,
            "step_overhead_seconds": self.step_overhead,
            "step_overhead_share": self.step_share,
            "bucket_overhead_seconds": self.bucket_overhead,
            "host_images_per_sec": self.host_images_per_sec,
            "inter_bits_per_sec": None if self.network is None else self.network.bandwidth * 8,
            "intra_bits_per_sec": None if self.devices is None else self.devices.bandwidth * 8,
        }

    @property
    def network(self) -> Link | None:
        """The link between hosts as the transport drives it: ``inter``'s line rate times ``efficiency``."""
        return None if self.inter is None else self.inter.at(self.efficiency)

    @property
    def devices(self) -> Link | None:
        """The link between a host's devices as the framework drives it: ``intra``'s rate times ``intra_efficiency``
        (a framework that stages gradients through host memory or reduces on one device reaches a fraction)."""
        return None if self.intra is None else self.intra.at(self.intra_efficiency)

    @property
    def link(self) -> Link:
        """The ring's bottleneck: the slower of the links it crosses (one host: its devices' link)."""
        links = [
            lk
            for lk in ((self.network if self.hosts > 1 else None), (self.devices if self.per_host > 1 else None))
            if lk is not None
        ]
        if not links:
            return self.devices or self.network or Link(math.inf)
        return Link(min(lk.bandwidth for lk in links), max(lk.latency for lk in links))

    @property
    def fabric(self) -> Fabric:
        """The hosts, their devices' link and their NICs, for the all-reduce algorithms."""
        intra = self.devices or self.network or Link(math.inf)  # no link inside a host given: the hosts' (as before)
        return Fabric(self.hosts, self.per_host, intra, self.network or Link(math.inf), self.nics)

    def with_workers(self, workers: int) -> Setting:
        """The same cluster shape grown or shrunk to ``workers`` (hosts filled one after another)."""
        per_host = min(self.per_host, workers)
        return replace(self, hosts=math.ceil(workers / per_host), per_host=per_host)


@dataclass
class Prediction:
    workers: int
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    wire_seconds: float
    hidden_seconds: float
    encode_seconds: float
    decode_seconds: float
    images_per_sec: float
    scaling_efficiency: float
    bytes_per_step_per_link: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Step:
    """What a mode adds to pure compute: the exposed part, and its parts for the report."""

    exposed: float
    wire: float
    encode: float = 0.0
    decode: float = 0.0
    link_bytes: float = 0.0
    hidden: float | None = None  # of ``wire``, what runs under compute (None: wire - exposed)


def predict(profile: Profile, setting: Setting) -> Prediction:
    """One optimizer step: ``accumulate`` micro-steps of compute, then the mode's exposed communication (under
    accumulation only the last micro-step's backward can hide it)."""
    compute = profile.compute_seconds * setting.compute_scale * setting.accumulate
    part = {"sync": _sync, "ps-sync": _ps_sync, "async": _async, "localsgd": _periodic, "diloco": _periodic}[
        setting.mode
    ](profile, setting)
    step = compute + part.exposed
    batch = (setting.batch_size or profile.batch_size) * setting.accumulate
    step = fed_step(step, setting.per_host, batch, setting.host_images_per_sec)
    images = setting.workers * batch / step
    return Prediction(
        setting.workers,
        step,
        compute,
        part.exposed,
        part.wire,
        max(0.0, part.wire - part.exposed) if part.hidden is None else part.hidden,
        part.encode,
        part.decode,
        images,
        compute / step,
        part.link_bytes,
    )


def fed_step(step: float, per_host: int, batch: int, host_images_per_sec: float | None) -> float:
    """``step`` no shorter than a host's input pipeline takes to feed its ``per_host`` devices ``batch`` images each
    (None: no limit)."""
    return max(step, per_host * batch / host_images_per_sec) if host_images_per_sec else step


def fit_step_overhead(profile: Profile, setting: Setting, host_images_per_sec: float) -> float:
    """The framework cost per synchronised step that makes one host of ``setting`` train at ``host_images_per_sec``,
    a throughput measured there: what the device's step, the links and the host's input pipeline leave unexplained
    (0 when the plan is already at or below the measurement). The cost is paid once a step whatever the cluster,
    so it carries over to the plan of many hosts."""
    if setting.mode != "sync":
        raise ConfigError(
            f"--one-host-images-per-sec calibrates the synchronous all-reduce's cost per step (--mode sync), "
            f"not --mode {setting.mode}"
        )
    host = replace(setting, hosts=1, step_overhead=0.0, step_share=0.0)
    plain = predict(profile, host)
    measured_step = plain.step_seconds * plain.images_per_sec / host_images_per_sec
    if measured_step <= plain.step_seconds:
        return 0.0
    return measured_step - plain.compute_seconds - plain.comm_seconds


LOWEST_EFFICIENCY = 1e-4  # a link fitted slower than this is not the link: refused


def fit_link_efficiency(profile: Profile, setting: Setting, two_host_images_per_sec: float) -> float:
    """The fraction of the line rate between hosts (``setting.efficiency``) at which two hosts of ``setting``, its cost
    per step included, train at ``two_host_images_per_sec``, a throughput measured there: what the transport, its
    stack and the way the framework drives it really achieve (1 when the plan at line rate is already at or below
    the measurement)."""
    _fittable(setting, setting.inter, "--two-host-images-per-sec", "between hosts", "--bandwidth", "[link.inter]")

    def rate(fraction: float) -> float:
        return predict(profile, replace(setting, hosts=2, efficiency=fraction)).images_per_sec

    return _fitted_fraction(rate, two_host_images_per_sec, "--two-host-images-per-sec", "two hosts", "between hosts")


def fit_intra_efficiency(profile: Profile, setting: Setting, two_device_images_per_sec: float) -> float:
    """The fraction of the devices' link (``setting.intra_efficiency``) at which two devices of one host of
    ``setting`` train at ``two_device_images_per_sec``, a throughput measured there: what the framework's
    all-reduce reaches of that link, which a spec does not say (GPUs without peer access reach each other through
    host memory; 1 when the plan at the link's rate is already at or below the measurement). It is held for every
    device count, so a host whose devices share a path (host memory) that two do not fill is planned too fast."""
    flag = "--two-device-images-per-sec"
    _fittable(setting, setting.intra, flag, "between a host's devices", "--intra-bandwidth", "[link.intra]")

    def rate(fraction: float) -> float:
        return predict(profile, replace(setting, hosts=1, per_host=2, intra_efficiency=fraction)).images_per_sec

    return _fitted_fraction(rate, two_device_images_per_sec, flag, "two devices", "inside a host")


def _fittable(setting: Setting, link: Link | None, flag: str, where: str, rate_flag: str, table: str) -> None:
    """A link's fraction is fitted for the synchronous all-reduce only, and only where the link is given."""
    if setting.mode != "sync":
        raise ConfigError(
            f"{flag} calibrates the synchronous all-reduce's link {where} (--mode sync), not --mode {setting.mode}"
        )
    if link is None:
        raise ConfigError(f"{flag} needs the link {where}: give {rate_flag}, or a cluster file with {table}")


def _fitted_fraction(rate: Callable[[float], float], measured: float, flag: str, what: str, link: str) -> float:
    """The fraction of a link's rate at which ``rate`` (the plan's images/s at that fraction) meets ``measured``;
    a plan is never faster on a slower link, so it is found by bisection (on a log scale)."""
    if rate(1.0) <= measured:
        return 1.0
    if rate(LOWEST_EFFICIENCY) > measured:
        raise ConfigError(
            f"{flag} {measured:g}: even at {LOWEST_EFFICIENCY:g} of the link's rate {link} the plan of {what} "
            f"trains faster ({rate(LOWEST_EFFICIENCY):,.0f} images/s), so the gap is not the link; check that both "
            "figures are for the same model, batch and workers per host"
        )
    low, high = LOWEST_EFFICIENCY, 1.0
    for _ in range(60):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if rate(middle) <= measured else (low, middle)
    return math.sqrt(low * high)


def _collectives(profile: Profile, spec: MethodSpec, grad_scale: float = 1.0) -> list[tuple[str, float]]:
    if spec.dense:
        return [("all_reduce", float(profile.gradient_bytes) * grad_scale)]
    return [(k, float(n)) for k, n in profile.compressor(spec).collectives]


def _coding(profile: Profile, setting: Setting) -> tuple[float, float]:
    """(encode, decode) seconds of one step at this many workers (all-gather decodes every payload)."""
    if setting.spec.dense:
        return 0.0, 0.0
    c = profile.compressor(setting.spec)
    scale = setting.compute_scale
    return c.encode.median * scale, c.decode.median * scale * (setting.workers if c.gathers else 1)


def _wire(collectives: list[tuple[str, float]], share: float, setting: Setting) -> float:
    """Seconds of one bucket's collectives: all-reduces by the setting's algorithm on its fabric (a flat ring
    by default, gloo's), all-gathers around the flat ring."""
    return sum(
        allreduce(n * share, setting.fabric, setting.algorithm)
        if kind == "all_reduce"
        else collective(kind, n * share, setting.workers, setting.fabric.bottleneck)
        for kind, n in collectives
    )


def _link_bytes(collectives: list[tuple[str, float]], workers: int) -> float:
    """Bytes over each link of the ring per step: 2(W-1)/W of an all-reduce, (W-1) payloads of an all-gather."""
    if workers <= 1:
        return 0.0
    return sum(n * (2.0 * (workers - 1) / workers if k == "all_reduce" else workers - 1) for k, n in collectives)


def _sync(profile: Profile, setting: Setting) -> _Step:
    if setting.workers == 1:
        return _Step(0.0, 0.0)
    collectives = _collectives(profile, setting.spec, setting.grad_scale)
    encode, decode = _coding(profile, setting)
    backward = profile.backward.median * setting.compute_scale
    if setting.spec.granularity == "entire":
        wire = _wire(collectives, 1.0, setting)
        return _Step(encode + wire + decode, wire, encode, decode, _link_bytes(collectives, setting.workers))
    total = sum(b.nbytes for b in profile.buckets)
    ready, durations, coded = [], [], 0.0
    for b in profile.buckets:
        share = b.nbytes / total
        coded += encode * share
        ready.append(b.ready_seconds * setting.compute_scale + coded)
        durations.append(_wire(collectives, share, setting) + setting.bucket_overhead + decode * share)
    finish = overlapped_finish(ready, durations)
    exposed = encode + max(0.0, finish - (backward + encode))
    if profile.on_cpu:  # decoding competes with backward for the same cores: it cannot hide under it
        exposed = max(exposed, encode + decode)
    wire = sum(durations) - decode
    # partial overlap: only a fraction of what hides under a perfect schedule really does (kernels and
    # collectives share the device); the rest of the in-flight time is exposed
    exposed = setting.overlap * exposed + (1.0 - setting.overlap) * max(exposed, encode + wire + decode)
    hidden = min(wire, max(0.0, encode + wire + decode - exposed))  # the step's own cost is not communication
    link_bytes = _link_bytes(collectives, setting.workers)
    own = setting.step_overhead + setting.step_share * profile.compute_seconds * setting.compute_scale
    return _Step(exposed + own, wire, encode, decode, link_bytes, hidden)


def _ps_bytes(profile: Profile, setting: Setting) -> tuple[float, float]:
    """(push, pull) bytes per worker step: pushes carry the compressor's payload, pulls the fp32 parameters."""
    return float(sum(n for _, n in _collectives(profile, setting.spec, setting.grad_scale))), float(
        profile.gradient_bytes
    )


def _tensors(profile: Profile, nbytes: float) -> list[float]:
    """The model's tensors scaled to ``nbytes`` in all (a compressed push shrinks each in proportion)."""
    sizes = [float(n) for n in profile.tensor_bytes] or [float(b.nbytes) for b in profile.buckets]
    total = sum(sizes)
    return [n * nbytes / total for n in sizes]


def _transfer(nbytes: float, setting: Setting, profile: Profile | None = None) -> float:
    """One push (or pull): one host's workers to servers in host memory, servers beside the workers of every
    host, or servers on hosts of their own; whole tensors or shards; the transport at its efficiency."""
    ps = setting.ps
    if ps == PSLayout():  # ps-lite's and trainscale's layout at line rate (the emulated clusters' model)
        if setting.hosts == 1:
            link = setting.devices or Link(math.inf)
            return parameter_server(nbytes, setting.workers, setting.servers, link, link)
        return colocated_parameter_server(nbytes, setting.hosts, setting.per_host, setting.network or Link(math.inf))
    if ps.assignment != "shard" and profile is not None and not profile.tensor_bytes:
        raise ConfigError(
            f"--ps-assignment {ps.assignment} places whole tensors, but this profile has no tensor sizes; "
            "take a profile with trainscale profile, or use --ps-assignment shard"
        )
    tensors = _tensors(profile, nbytes) if profile is not None else [nbytes]
    if ps.placement == "separate" or setting.hosts == 1:
        net = setting.fabric.network if setting.hosts > 1 or ps.placement == "separate" else setting.fabric.intra
        worker = Link(net.bandwidth / setting.per_host, net.latency)  # a host's workers share its NICs
        return placed_parameter_server(
            tensors, setting.workers, setting.servers, worker, net, ps.assignment, ps.efficiency
        )
    return _colocated(tensors, setting)


def _colocated(tensors: list[float], setting: Setting) -> float:
    """Servers beside the workers: ``servers`` on every host; each host sends its workers' pushes for what
    lives elsewhere and its servers receive their load from every other host's workers."""
    h, g, net = setting.hosts, setting.per_host, setting.fabric.network
    if setting.ps.total is not None:  # one server on each of the first ``total`` hosts
        loads = server_loads(tensors, min(setting.ps.total, h), setting.ps.assignment)
        per_host = loads + [0.0] * (h - len(loads))
    else:
        loads = server_loads(tensors, h * setting.servers, setting.ps.assignment)
        per_host = [sum(loads[i * setting.servers : (i + 1) * setting.servers]) for i in range(h)]
    total = sum(tensors)
    out = g * (total - min(per_host))
    into = (setting.workers - g) * max(per_host)
    return max(out, into) / net.bandwidth / setting.ps.efficiency + (h - 1) * net.latency


def _ps_link_bytes(profile: Profile, setting: Setting) -> float:
    """Bytes over a worker host's link per step: every push and pull of its workers where the servers have hosts
    of their own; where they sit beside the workers, the share that lives on the other hosts."""
    h, g = setting.hosts, setting.per_host
    total = sum(_ps_bytes(profile, setting))
    if setting.ps.placement == "separate":
        return g * total
    return g * (h - 1) / h * total if h > 1 else 0.0


def _ps_coding(profile: Profile, setting: Setting) -> tuple[float, float]:
    """(encode, decode) seconds of compressed pushes per step: the worker encodes its push; the servers decode
    every worker's, ``workers / servers`` pushes per shard."""
    if setting.spec.dense:
        return 0.0, 0.0
    c = profile.compressor(setting.spec)
    scale = setting.compute_scale
    return c.encode.median * scale, c.decode.median * scale * setting.workers / setting.servers


def _ps_sync(profile: Profile, setting: Setting) -> _Step:
    if setting.workers == 1:  # one worker steps its own model: nothing to push or pull
        return _Step(0.0, 0.0)
    encode, decode = _ps_coding(profile, setting)
    wire = sum(_transfer(n, setting, profile) for n in _ps_bytes(profile, setting))
    return _Step(encode + wire + decode, wire, encode, decode, _ps_link_bytes(profile, setting))


def _async(profile: Profile, setting: Setting) -> _Step:
    push, pull = (_transfer(n, setting, profile) for n in _ps_bytes(profile, setting))
    encode, decode = _ps_coding(profile, setting)
    own = encode + push + decode + pull
    others = pull if setting.hosts > 1 else 0.0  # the host's shard answers the other hosts' pulls
    c = profile.compute_seconds * setting.compute_scale * setting.accumulate
    total = c + others + own
    step = (total + math.sqrt(max(0.0, total * total - 4.0 * c * others))) / 2.0
    return _Step(step - c, push + pull, encode, decode, _ps_link_bytes(profile, setting))


def _periodic(profile: Profile, setting: Setting) -> _Step:
    """Local SGD / DiLoCo: one exchange of the model (through the compressor) every ``sync_every`` steps."""
    if setting.workers == 1:
        return _Step(0.0, 0.0)
    collectives = _collectives(profile, setting.spec, setting.grad_scale)
    encode, decode = _coding(profile, setting)
    wire = _wire(collectives, 1.0, setting)
    h = setting.sync_every
    return _Step(
        (encode + wire + decode) / h, wire / h, encode / h, decode / h, _link_bytes(collectives, setting.workers) / h
    )


LOWEST, HIGHEST = 1e5 / 8, 1e12 / 8  # bytes/s: 100 kbit/s to 1 Tbit/s


def crossover(
    profile: Profile, setting: Setting, baseline: Setting, low: float = LOWEST, high: float = HIGHEST
) -> float | None:
    """The bandwidth (bytes/s) below which ``setting`` steps faster than ``baseline`` on the same links, or
    None when it never does in [low, high] (or always does: then ``high``)."""

    def gain(bw: float) -> float:
        def at(s: Setting) -> Setting:
            return replace(
                s,
                inter=replace(s.inter or Link(bw), bandwidth=bw),
                intra=replace(s.intra, bandwidth=bw) if s.intra and s.hosts == 1 else s.intra,
            )

        return predict(profile, at(baseline)).step_seconds - predict(profile, at(setting)).step_seconds

    if gain(low) <= 0:
        return None
    if gain(high) > 0:
        return high
    lo, hi = math.log(low), math.log(high)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(math.exp(mid)) > 0 else (lo, mid)
    return math.exp(lo)


def crossover_text(found: float | None) -> str:
    """A crossover from :func:`crossover` as text: never, at every bandwidth, or N Mbit/s / Gbit/s."""
    if found is None:
        return "never"
    if found >= HIGHEST:
        return "at every bandwidth"
    bits = float(f"{found * 8:.3g}")
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"
