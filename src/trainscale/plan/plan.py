"""``trainscale plan``: the settings of a plan (a config section, so the flags derive from it) and how
they become a :class:`~trainscale.plan.predict.Setting`: a cluster file, or hosts and link figures."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from trainscale.config import Section, option
from trainscale.errors import ConfigError
from trainscale.models.registry import count_parameters, create_model, list_models
from trainscale.plan.costs import ALGORITHMS, ASSIGNMENTS, Link
from trainscale.plan.describe import (
    MAX_COUNT,
    ClusterSpec,
    System,
    load_cluster,
    load_device,
    parse_latency,
    parse_link,
)
from trainscale.plan.inputs import InputRate
from trainscale.plan.methods import parse_spec
from trainscale.plan.predict import (
    MODES,
    PSLayout,
    Setting,
    fit_intra_efficiency,
    fit_link_efficiency,
    fit_step_overhead,
)
from trainscale.plan.profile import Profile, load_profile
from trainscale.plan.synthetic import synthetic_profile
from trainscale.runtime.cluster import format_rate

GRAD_DTYPES = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5}  # bytes over fp32's
PROFILE_DEFAULT = "profile.json"
PS_MODES = ("ps-sync", "async")
PERIODIC_MODES = ("localsgd", "diloco")


@dataclass
class PlanConfig(Section):
    TITLE: ClassVar[str] = "plan"

    profile: str = option(
        PROFILE_DEFAULT, "a profile from trainscale profile (this machine's compute, buckets, coding times)"
    )
    model: str | None = option(None, "the model the plan is for; refused if the profile measured another")
    cluster: str | None = option(None, "a cluster file: a name in configs/clusters (e.g. pslite-gtx980) or a path")
    hosts: int | None = option(None, "hosts (default: the cluster file's)", at_least=1, at_most=MAX_COUNT)
    workers_per_host: int | None = option(
        None, "workers (devices) per host (default: the cluster file's, or 1)", at_least=1, at_most=MAX_COUNT
    )
    bandwidth: str | None = option(
        None,
        "link rate between hosts: 100mbit, 1gbit, 25Gbps (b: bits), 12GB/s (B: bytes) (default: the cluster file's)",
    )
    latency: str | None = option(
        None, "one-way latency per message between hosts: 50us, 1ms (default: the cluster file's, or 0us)"
    )
    intra_bandwidth: str | None = option(
        None, "link rate between the workers of one host (default: the cluster file's, or no limit)"
    )
    device: str | None = option(None, "plan for this device (configs/devices) instead of this machine's profile")
    device_step_ms: float | None = option(
        None, "or give the target device's step time in ms at the profile's batch", above=0
    )
    params: int | None = option(
        None, "plan a model by its parameter count instead of a profile (with --step-time and --batch-size)", at_least=1
    )
    step_time: str | None = option(
        None, "the target device's step time (one device, no communication) at --batch-size: 120ms, 0.12s"
    )
    batch_size: int | None = option(
        None, "per-device batch of the plan (default: the profile's; compute scales in proportion)", at_least=1
    )
    bucket_mb: float = option(25.0, "--params: DDP's gradient bucket size in MiB (bucket_cap_mb)", above=0)
    grad_dtype: str = option("fp32", "dtype of the gradients sent: fp32, bf16 or fp16", choices=tuple(GRAD_DTYPES))
    accumulate: int = option(1, "micro-steps per optimizer step (one communication per N)", at_least=1)
    intra_latency: str | None = option(
        None, "latency per message between the workers of one host (default: the cluster file's, or 0us)"
    )
    nics: int | None = option(None, "network interfaces per host (default: the cluster file's, or 1)", at_least=1)
    efficiency: float | None = option(
        None, "the transport's achieved fraction of line rate (default: the cluster file's, or 1)", above=0, at_most=1
    )
    intra_efficiency: float | None = option(
        None,
        "the framework's achieved fraction of the devices' link inside a host (default: the cluster file's, or 1)",
        above=0,
        at_most=1,
    )
    algorithm: str = option(
        "auto",
        "all-reduce algorithm: ring, tree, hierarchical; auto: the cluster file's, else NCCL's choice for a "
        "GPU plan and gloo's ring for this machine's CPU",
        choices=("auto", *ALGORITHMS),
    )
    overlap: float | None = option(
        None,
        "fraction of in-flight communication that hides under backward (default: the cluster file's; else the "
        "profile's measurement for its own device, 0 for another device, as published NCCL runs show)",
        at_least=0,
        at_most=1,
    )
    bucket_overhead: str | None = option(
        None, "framework cost per gradient bucket, e.g. 100us (default: the file's, the profile's measurement, or 0)"
    )
    step_overhead: str | None = option(
        None, "framework cost per synchronised step, e.g. 2ms (default: the file's, the profile's measurement, or 0)"
    )
    ps_placement: str | None = option(
        None,
        "parameter servers beside the workers (colocated) or on hosts of their own (separate)",
        choices=("colocated", "separate"),
    )
    ps_assignment: str | None = option(
        None, "tensors to servers: shard (split evenly), round_robin or by_size (whole tensors)", choices=ASSIGNMENTS
    )
    ps_efficiency: float | None = option(
        None,
        "a parameter server's achieved fraction of what the link carries (RPC stacks: below 1)",
        above=0,
        at_most=1,
    )
    host_images_per_sec: float | None = option(
        None, "images/s one host's CPUs and input pipeline deliver at most (measure it; default: no limit)", above=0
    )
    one_host_images_per_sec: float | None = option(
        None,
        "images/s you measured on one host of the plan's workers per host (same model, batch and framework): the "
        "plan fits the framework's cost per step to it and carries it to every host count",
        above=0,
    )
    two_host_images_per_sec: float | None = option(
        None,
        "and the images/s you measured on two such hosts: the plan fits the link's achieved fraction of its line "
        "rate between hosts to it (with --one-host-images-per-sec)",
        above=0,
    )
    two_device_images_per_sec: float | None = option(
        None,
        "images/s you measured on two workers of one host (same model, batch and framework): the plan fits the "
        "achieved fraction of the link between a host's workers to it (GPUs without peer access reach far less)",
        above=0,
    )
    mode: str = option("sync", "sync, ps-sync, async, localsgd or diloco", choices=MODES)
    compress: str = option("none", "the compressor, as profiled: METHOD[:key=value,...] (e.g. bf16)")
    sync_every: int = option(1, "localsgd / diloco: steps between exchanges (H)", at_least=1)
    servers: int = option(
        1, "parameter-server shards per host (colocated; on one host: in all) or in all (separate)", at_least=1
    )
    sweep: list[str] = option(
        [],
        "workers=1,2,4,8 bandwidth=100mbit,1gbit,10gbit: a table over both, the "
        "crossover bandwidth of every profiled compressor, and a plot",
    )
    plot: str = option("plan_sweep.png", "where --sweep draws scaling efficiency against workers")
    json: bool = option(False, "print the plan as one JSON object")

    def validate(self) -> None:
        """Flags the plan would not read where they were given: refused, not dropped."""
        if self.params is not None and self.profile != PROFILE_DEFAULT:
            raise ConfigError(f"--params plans a model without a profile; drop --profile {self.profile}, or --params")
        idle = [
            (flag, modes)
            for flag, given, modes in (
                ("--servers", self.servers != 1, PS_MODES),
                ("--ps-placement", self.ps_placement is not None, PS_MODES),
                ("--ps-assignment", self.ps_assignment is not None, PS_MODES),
                ("--ps-efficiency", self.ps_efficiency is not None, PS_MODES),
                ("--sync-every", self.sync_every != 1, PERIODIC_MODES),
            )
            if given and self.mode not in modes
        ]
        if idle:
            flag, modes = idle[0]
            raise ConfigError(f"{flag} is for --mode {' or '.join(modes)}, and this plan is --mode {self.mode}")


def check_profile_model(cfg: PlanConfig, profile: Profile) -> None:
    if cfg.model is not None and cfg.model != profile.model:
        raise ConfigError(
            f"--profile {cfg.profile} measured {profile.model}, not --model {cfg.model}; profile "
            f"{cfg.model} with trainscale profile --model {cfg.model}"
        )


def plan_profile(cfg: PlanConfig) -> Profile:
    """The profile a plan rests on: the file, or one made from ``--params`` and ``--step-time``."""
    if cfg.params is None:
        return load_profile(cfg.profile)
    if cfg.step_time is None or cfg.batch_size is None:
        raise ConfigError(
            f"--params {cfg.params} needs --step-time (one device's step, e.g. 120ms) and the --batch-size it is for"
        )
    if cfg.device is not None or cfg.device_step_ms is not None:
        raise ConfigError("--params takes the device's step from --step-time; drop --device / --device-step-ms")
    if cfg.compress != "none":
        raise ConfigError(
            f"--params plans dense gradients (no coding times without a profile); drop --compress {cfg.compress}, "
            "or use --grad-dtype bf16 for 16-bit gradients"
        )
    seconds = parse_latency(cfg.step_time, "--step-time")
    if not seconds > 0:
        raise ConfigError(f"--step-time must be positive, got {cfg.step_time}")
    return synthetic_profile(cfg.params, seconds, cfg.batch_size, cfg.bucket_mb, cfg.model)


def _batch_scale(cfg: PlanConfig, profile: Profile) -> tuple[float, str]:
    """Compute at the plan's batch over the profile's (in proportion to the images: an assumption the plan
    states, as a device's throughput is flat only once it is full)."""
    if cfg.batch_size is None or cfg.batch_size == profile.batch_size:
        return 1.0, ""
    return cfg.batch_size / profile.batch_size, (
        f"; scaled from batch {profile.batch_size} to {cfg.batch_size} in proportion (assumed)"
    )


def _params_note(params: int, model: str | None) -> str:
    """Where ``--model`` names a model of trainscale's whose size is far from ``--params`` (over 2x either way), a
    word in the plan: the gradients planned are ``--params``'s, the name only labels them."""
    if model is None or model not in list_models():
        return ""
    with torch.device("meta"):
        own = count_parameters(create_model(model))
    if own and 0.5 <= params / own <= 2:
        return ""
    return f"; note: --model {model} has {own:,} parameters here, the plan sends the gradients of --params {params:,}"


def compute_scale(cfg: PlanConfig, profile: Profile, device: str | None) -> tuple[float, str]:
    """Target device's step time over this machine's (1 when the plan is for this machine), and its origin."""
    if cfg.params is not None:
        return 1.0, f"--step-time {cfg.step_time} at batch {cfg.batch_size} (given; backward 2/3 of it, assumed)" + (
            _params_note(cfg.params, cfg.model)
        )
    batch = cfg.batch_size or profile.batch_size
    if cfg.step_time is not None and cfg.device_step_ms is not None:
        raise ConfigError("give --step-time or --device-step-ms, not both")
    if cfg.step_time is not None:
        seconds = parse_latency(cfg.step_time, "--step-time")
        if not seconds > 0:
            raise ConfigError(f"--step-time must be positive, got {cfg.step_time}")
        return seconds / profile.compute_seconds, f"--step-time {cfg.step_time} at batch {batch}"
    if cfg.device_step_ms is not None:
        if cfg.device_step_ms <= 0:
            raise ConfigError(f"--device-step-ms must be positive, got {cfg.device_step_ms}")
        scale, note = _batch_scale(cfg, profile)
        return (
            cfg.device_step_ms / 1e3 / profile.compute_seconds * scale,
            f"--device-step-ms {cfg.device_step_ms:g}{note}",
        )
    if device is None:
        scale, note = _batch_scale(cfg, profile)
        return scale, f"profiled: {profile.device}, {profile.threads} thread(s)" + (
            f", {profile.cpus:g} CPUs" if profile.cpus else ""
        ) + note
    target = load_device(device)
    seconds, figure = target.step_seconds(profile.model, batch, profile.precision)
    origin = (
        f"{target.name}: {figure.images_per_sec:g} img/s at batch {figure.batch_size}, {figure.precision} "
        f"({figure.source})"
    )
    return seconds / profile.compute_seconds, origin


# What a GPU plan takes for the overlap when neither the cluster file nor --overlap gives one: none. Fitted on
# published NCCL runs (1-32 V100, NVLink inside hosts, InfiniBand between them) and held on every other published
# framework: no overlap plans them best (benchmarks/plan_published.py --calibrate); perfect overlap over-predicts.
GPU_OVERLAP = 0.0
# And the framework's cost per synchronised step, as a share of the device's step, when nothing gives one (DDP's
# bucket copies, NCCL's kernels beside backward's: a data-parallel step is a few percent slower than one device's
# alone). Fitted on the same published NCCL runs as the overlap; the other publishers' all-reduce rows, fitted
# alone, want a share of the step too (benchmarks/plan_published.py --calibrate).
GPU_STEP_SHARE = 0.03


def system_of(
    cfg: PlanConfig, cluster: ClusterSpec | None, on_gpu: bool, measured: dict[str, float] | None = None
) -> tuple[System, list[str]]:
    """The cluster file's system (or the defaults) with the flags given on top, and the values still assumed.
    What the file does not give, ``measured`` (the profile's figures, when the plan is for the device it was
    taken on) fills; a GPU plan's overlap, if still unknown, is what published NCCL runs show
    (:data:`GPU_OVERLAP`); a plan for this machine's CPU keeps the profile's own bucket timing."""
    base = cluster.system if cluster is not None else System()
    found: dict[str, Any] = {k: v for k, v in (measured or {}).items() if k in base.assumed}
    base = replace(base, **found, assumed=tuple(k for k in base.assumed if k not in found))
    if on_gpu and "overlap" in base.assumed:
        base = replace(base, overlap=GPU_OVERLAP)
    given: dict[str, Any] = {
        "nics": cfg.nics,
        "algorithm": cfg.algorithm if cfg.algorithm != "auto" else None,
        "overlap": cfg.overlap,
        "bucket_overhead": None
        if cfg.bucket_overhead is None
        else parse_latency(cfg.bucket_overhead, "--bucket-overhead"),
        "step_overhead": None if cfg.step_overhead is None else parse_latency(cfg.step_overhead, "--step-overhead"),
        "placement": cfg.ps_placement,
        "assignment": cfg.ps_assignment,
        "efficiency": cfg.efficiency,
        "intra_efficiency": cfg.intra_efficiency,
        "ps_efficiency": cfg.ps_efficiency,
        "host_images_per_sec": cfg.host_images_per_sec,
    }
    given = {k: v for k, v in given.items() if v is not None}
    system = replace(base, **given)
    if system.algorithm is None:
        system = replace(system, algorithm="auto" if on_gpu else "ring")
    assumed = [k for k in base.assumed if k not in given]
    return system, assumed


def measured_on_device(cfg: PlanConfig, profile: Profile, device: str | None, per_host: int) -> dict[str, float]:
    """The overlap, the per-step and per-bucket costs and the input pipeline's rate (for a host of ``per_host``
    workers like the machine it was measured on) that the profile measured, when the plan is for the device it was
    taken on (not when another device's step time or published figure replaces it)."""
    if device is not None or cfg.step_time is not None or cfg.device_step_ms is not None:
        return {}
    rate = host_input_rate(profile, per_host)
    return {**profile.measured_costs(), **({"host_images_per_sec": rate} if rate is not None else {})}


def host_input_rate(profile: Profile, per_host: int) -> float | None:
    """The profile's input pipeline on a host like its machine running ``per_host`` training processes."""
    if profile.input_images_per_sec is None or profile.input_workers is None or profile.input_cores is None:
        return None
    rate = InputRate(profile.input_images_per_sec, profile.input_workers, profile.input_cores)
    return rate.host_rate(per_host, profile.input_cores)


def _setting(
    cfg: PlanConfig, hosts: int, per_host: int, inter: Link | None, intra: Link | None, system: System, scale: float
) -> Setting:
    return Setting(
        hosts,
        per_host,
        inter,
        intra,
        cfg.mode,
        parse_spec(cfg.compress),
        cfg.sync_every,
        system.servers or cfg.servers,
        scale,
        cfg.batch_size,
        GRAD_DTYPES[cfg.grad_dtype],
        cfg.accumulate,
        system.algorithm or "ring",
        system.nics,
        system.overlap,
        system.bucket_overhead,
        system.step_overhead,
        PSLayout(system.placement, system.assignment, system.ps_efficiency),
        system.host_images_per_sec,
        system.efficiency,
        intra_efficiency=system.intra_efficiency,
    )


def setting_from(cfg: PlanConfig, profile: Profile) -> tuple[Setting, ClusterSpec | None, str]:
    """The Setting a plan describes, the cluster file it came from (if any), and where compute comes from
    (with the system values the plan assumed rather than was given)."""
    cluster = load_cluster(cfg.cluster) if cfg.cluster else None
    hosts, per_host, inter, intra = layout_of(cfg, cluster)
    device = cfg.device or (cluster.device if cluster else None)
    scale, origin = compute_scale(cfg, profile, device)
    on_gpu = device is not None or not profile.on_cpu or cfg.step_time is not None or cfg.device_step_ms is not None
    measured = measured_on_device(cfg, profile, device, per_host)
    system, assumed = system_of(cfg, cluster, on_gpu, measured)
    check_server_link(cfg, system, inter)
    setting = _setting(cfg, hosts, per_host, inter, intra, system, scale)
    if on_gpu and "step_overhead" in assumed:
        setting = replace(setting, step_share=GPU_STEP_SHARE)
    if cfg.two_device_images_per_sec is not None:
        intra_given = cfg.intra_bandwidth is not None or (cluster is not None and cluster.intra is not None)
        setting, note = fitted_to_two_devices(cfg, profile, setting, intra_given)
        origin += note
        assumed = [k for k in assumed if k != "intra_efficiency"]
    if cfg.one_host_images_per_sec is not None:
        setting, note = fitted_to_one_host(cfg, profile, setting)
        origin += note
        assumed = [k for k in assumed if k != "step_overhead"]
    if cfg.two_host_images_per_sec is not None:
        setting, note = fitted_to_two_hosts(cfg, profile, setting)
        origin += note
        assumed = [k for k in assumed if k != "efficiency"]
    uncharged = not_charged(cfg, hosts, per_host, system)
    assumed = [k for k in assumed if k not in uncharged]
    if cfg.mode != "sync":
        measured = {k: v for k, v in measured.items() if k not in SYNC_ONLY}
    unknown = (cluster.system if cluster is not None else System()).assumed
    flags = {
        "overlap": cfg.overlap,
        "step_overhead": cfg.step_overhead if cfg.one_host_images_per_sec is None else "fitted",
        "bucket_overhead": cfg.bucket_overhead,
        "host_images_per_sec": cfg.host_images_per_sec,
    }
    used = {k: v for k, v in measured.items() if k in unknown and flags[k] is None}
    if used:
        origin += "; measured by trainscale profile: " + ", ".join(_MEASURED_TEXT[k](v) for k, v in used.items())
    texts = [_ASSUMED_TEXT[k] for k in assumed] if on_gpu else []
    if per_host > 1 and cfg.intra_bandwidth is None and (cluster is None or cluster.intra is None):
        texts.append(f"no limit on the link between a host's workers ({NO_LIMIT}; give --intra-bandwidth)")
    if texts:
        origin += f"; assumed (not given): {', '.join(texts)}"
    return setting, cluster, origin


def not_charged(cfg: PlanConfig, hosts: int, per_host: int, system: System) -> set[str]:
    """The system values this plan does not charge, so it need not say it assumed them: the overlap and framework
    costs outside the synchronous all-reduce, the servers' efficiency without servers, the line rate between hosts
    where no link between hosts is used, the devices' link fraction with one device a host."""
    uncharged = set(SYNC_ONLY) if cfg.mode != "sync" else set()
    uncharged |= {"ps_efficiency"} if cfg.mode not in ("ps-sync", "async") else set()
    uncharged |= {"efficiency"} if hosts == 1 and not servers_apart(cfg.mode, system.placement) else set()
    uncharged |= {"intra_efficiency"} if per_host == 1 else set()
    return uncharged


def servers_apart(mode: str, placement: str) -> bool:
    """Whether the plan has parameter servers on hosts of their own, which the workers reach over the link
    between hosts."""
    return mode in PS_MODES and placement == "separate"


def check_server_link(cfg: PlanConfig, system: System, inter: Link | None) -> None:
    """Parameter servers on hosts of their own are reached over the network, on one host of workers too: without
    a link between hosts their traffic would cost nothing."""
    if servers_apart(cfg.mode, system.placement) and inter is None:
        where = "--ps-placement separate" if cfg.ps_placement else f'{cfg.cluster}\'s ps_placement = "separate"'
        raise ConfigError(
            f"{where} puts the parameter servers on hosts of their own: give --bandwidth (the link rate to them, "
            "e.g. 10gbit), or a cluster file with a [link.inter]"
        )


def layout_of(cfg: PlanConfig, cluster: ClusterSpec | None) -> tuple[int, int, Link | None, Link | None]:
    """Hosts, workers per host and the links between and inside hosts: the cluster file's, each replaced by its
    flag where one is given (a flag's link replaces the file's whole link, its socket hop included)."""
    if cluster is None:
        if cfg.hosts is None:
            raise ConfigError(
                "give --cluster NAME, or --hosts N with --bandwidth RATE (e.g. --hosts 4 --bandwidth 1gbit)"
            )
        if cfg.hosts > 1 and cfg.bandwidth is None:
            raise ConfigError(f"--hosts {cfg.hosts} needs --bandwidth (the link rate between hosts, e.g. 1gbit)")
    hosts = cfg.hosts or (cluster.hosts if cluster else 1)
    per_host = cfg.workers_per_host or (cluster.devices_per_host if cluster else 1)
    inter = _link_of(cfg.bandwidth, cfg.latency, "--bandwidth", cluster.inter if cluster else None)
    inside = cluster.intra if cluster else parse_link(NO_LIMIT)
    intra = _link_of(cfg.intra_bandwidth, cfg.intra_latency, "--intra-bandwidth", inside)
    if hosts > 1 and inter is None:
        raise ConfigError(
            f"{hosts} hosts need a link between them: give --bandwidth (e.g. 25gbit), or a cluster file with a "
            "[link.inter]"
        )
    if per_host > 1 and intra is None:
        raise ConfigError(
            f"{per_host} workers per host need a link between them: give --intra-bandwidth (e.g. 300GB/s), or a "
            "cluster file with a [link.intra]"
        )
    return hosts, per_host, inter, intra


def unused_bandwidth(cfg: PlanConfig, setting: Setting, workers: list[int]) -> str:
    """A word in the plan where ``--bandwidth`` was given but no host count planned (the plan's, or a swept one of
    ``workers``) has a second host to reach over it, nor servers on hosts of their own."""
    if setting.hosts > 1 or cfg.bandwidth is None or max(workers) > setting.per_host:
        return ""
    if servers_apart(cfg.mode, setting.ps.placement):
        return ""  # the link to the servers' hosts
    return f"; --bandwidth {cfg.bandwidth} unused: one host (it is the link between hosts)"


NO_LIMIT = "10000gbit"  # the link inside a host when none is given: far beyond any device's need


def _link_of(bandwidth: str | None, latency: str | None, flag: str, base: Link | None) -> Link | None:
    """``base`` with the rate and latency the flags give (``flag`` names the rate's flag in errors); a rate given
    alone keeps the base's latency."""
    where = flag.replace("bandwidth", "latency")
    if bandwidth is not None:
        link = parse_link(bandwidth, latency or "0us", flag)
        return replace(link, latency=base.latency) if latency is None and base is not None else link
    if latency is None:
        return base
    if base is None:
        raise ConfigError(f"{where} needs a link: give {flag} too")
    return replace(base, latency=parse_latency(latency, where))


def fitted_to_one_host(cfg: PlanConfig, profile: Profile, setting: Setting) -> tuple[Setting, str]:
    """``setting`` with the framework's cost per step fitted to a throughput the user measured on one host
    (``--one-host-images-per-sec``), and what the plan says of it."""
    rate = cfg.one_host_images_per_sec
    assert rate is not None  # called only when given
    if cfg.step_overhead is not None:
        raise ConfigError(
            "give --one-host-images-per-sec (the cost per step is fitted to it) or --step-overhead, not both"
        )
    overhead = fit_step_overhead(profile, setting, rate)
    setting = replace(setting, step_share=0.0)  # the measured cost replaces the assumed one
    if overhead == 0.0:
        return setting, (
            f"; your one host's {rate:,.0f} images/s (--one-host-images-per-sec) is at or above this plan's: "
            "no cost per step"
        )
    return replace(setting, step_overhead=overhead), (
        f"; framework cost per step {1e3 * overhead:.1f} ms, fitted to your one host's {rate:,.0f} images/s "
        f"(--one-host-images-per-sec)"
    )


def fitted_to_two_devices(
    cfg: PlanConfig, profile: Profile, setting: Setting, intra_given: bool
) -> tuple[Setting, str]:
    """``setting`` with the link between a host's workers at the fraction of its rate fitted to a throughput the
    user measured on two of them (``--two-device-images-per-sec``), and what the plan says of it. The fit
    replaces a cluster file's intra-host efficiency; it comes before ``--one-host-images-per-sec``'s. A fraction
    needs the link's rate (``intra_given``), not the unlimited link a plan takes when none is given."""
    rate = cfg.two_device_images_per_sec
    assert rate is not None  # called only when given
    if setting.per_host < 2:
        raise ConfigError(
            "--two-device-images-per-sec fits the link between a host's workers, and this plan has one worker per "
            "host: give --workers-per-host"
        )
    if cfg.intra_efficiency is not None:
        raise ConfigError(
            "give --two-device-images-per-sec (the devices' link's efficiency is fitted to it) or "
            "--intra-efficiency, not both"
        )
    if not intra_given:
        raise ConfigError(
            "--two-device-images-per-sec fits the achieved fraction of the link between a host's workers: give "
            "its rate (--intra-bandwidth, or a cluster file's [link.intra])"
        )
    fraction = fit_intra_efficiency(profile, setting, rate)
    note = (
        f"; your two devices' {rate:,.0f} images/s (--two-device-images-per-sec) is at or above this plan's: "
        "the link between a host's workers at its full rate"
        if fraction == 1.0
        else f"; the link between a host's workers at {fraction:.1%} of its rate, fitted to your two devices' "
        f"{rate:,.0f} images/s (--two-device-images-per-sec)"
    )
    return replace(setting, intra_efficiency=fraction), note


def fitted_to_two_hosts(cfg: PlanConfig, profile: Profile, setting: Setting) -> tuple[Setting, str]:
    """``setting`` with the link between hosts at the fraction of its line rate fitted to a throughput the user
    measured on two hosts (``--two-host-images-per-sec``, after the cost per step was fitted to one host), and
    what the plan says of it. The fit replaces a cluster file's efficiency."""
    rate = cfg.two_host_images_per_sec
    assert rate is not None  # called only when given
    if cfg.one_host_images_per_sec is None:
        raise ConfigError(
            "--two-host-images-per-sec needs --one-host-images-per-sec: the cost per step is fitted to one host "
            "first, then the link between hosts to two"
        )
    if cfg.efficiency is not None:
        raise ConfigError(
            "give --two-host-images-per-sec (the link's efficiency is fitted to it) or --efficiency, not both"
        )
    fraction = fit_link_efficiency(profile, setting, rate)
    return replace(setting, efficiency=fraction), (
        f"; the link between hosts at {fraction:.1%} of its line rate, fitted to your two hosts' {rate:,.0f} "
        "images/s (--two-host-images-per-sec)"
    )


SYNC_ONLY = ("overlap", "bucket_overhead", "step_overhead")  # what only the synchronous all-reduce pays

_MEASURED_TEXT = {
    "overlap": lambda v: f"overlap {v:.2f}",
    "step_overhead": lambda v: f"DDP's cost per step {1e3 * v:.1f} ms",
    "bucket_overhead": lambda v: f"cost per bucket {1e6 * v:.0f} us",
    "host_images_per_sec": lambda v: f"input pipeline {v:,.0f} images/s per host",
}


_ASSUMED_TEXT = {
    "overlap": "no overlap of communication with backward (as published NCCL runs show)",
    "bucket_overhead": "no per-bucket cost",
    "step_overhead": f"a per-step cost of {GPU_STEP_SHARE:.0%} of the device's step (as published NCCL runs show)",
    "efficiency": "the link between hosts at its line rate",
    "intra_efficiency": "the devices' link at its full rate",
    "ps_efficiency": "servers at line rate",
    "host_images_per_sec": "no input-pipeline limit",
}


def swept_rate(setting: Setting) -> str:
    """The line rate :func:`with_bandwidth` replaces, as text ("unlimited" where none is given): what a sweep
    without a bandwidth list plans at (the transport's efficiency is charged on it, once)."""
    link = setting.inter if _sweeps_hosts(setting) else setting.intra
    if link is None or math.isinf(link.bandwidth):
        return "unlimited"
    return format_rate(round(link.bandwidth * 8))


def _sweeps_hosts(setting: Setting) -> bool:
    return setting.hosts > 1 or setting.inter is not None


def with_bandwidth(setting: Setting, text: str) -> Setting:
    """The setting with its slow link (between hosts; on one host, between devices) at ``text``."""
    link = parse_link(text, "0us", "--sweep bandwidth")
    if _sweeps_hosts(setting):
        base = setting.inter or link
        return replace(setting, inter=replace(base, bandwidth=link.bandwidth))
    base = setting.intra or link
    return replace(setting, intra=replace(base, bandwidth=link.bandwidth))
