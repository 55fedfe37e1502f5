"""``trainscale plan``: the settings of a plan (a config section, so the flags derive from it) and how
they become a :class:`~trainscale.plan.predict.Setting`: a cluster file, or hosts and link figures."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from trainscale.config import Section, option
from trainscale.errors import ConfigError
from trainscale.plan.describe import MAX_COUNT, ClusterSpec, load_cluster, load_device, parse_link
from trainscale.plan.methods import parse_spec
from trainscale.plan.predict import MODES, Setting
from trainscale.plan.profile import Profile


@dataclass
class PlanConfig(Section):
    TITLE: ClassVar[str] = "plan"

    profile: str = option(
        "profile.json", "a profile from trainscale profile (this machine's compute, buckets, coding times)"
    )
    model: str | None = option(None, "the model the plan is for; refused if the profile measured another")
    cluster: str | None = option(None, "a cluster file: a name in configs/clusters (e.g. pslite-gtx980) or a path")
    hosts: int | None = option(None, "hosts, without --cluster", at_least=1, at_most=MAX_COUNT)
    workers_per_host: int = option(1, "workers (devices) per host, without --cluster", at_least=1, at_most=MAX_COUNT)
    bandwidth: str | None = option(None, "link rate between hosts, tc's units: 100mbit, 1gbit, 10gbit")
    latency: str = option("0us", "one-way latency per message between hosts: 50us, 1ms")
    intra_bandwidth: str = option("10000gbit", "link rate between the workers of one host (default: no limit)")
    device: str | None = option(None, "plan for this device (configs/devices) instead of this machine's profile")
    device_step_ms: float | None = option(
        None, "or give the target device's step time in ms at the profile's batch", above=0
    )
    mode: str = option("sync", "sync, ps-sync, async, localsgd or diloco", choices=MODES)
    compress: str = option("none", "the compressor, as profiled: METHOD[:key=value,...] (e.g. bf16)")
    sync_every: int = option(1, "localsgd / diloco: steps between exchanges (H)", at_least=1)
    servers: int = option(1, "parameter-server shards per host (on one host: in all)", at_least=1)
    sweep: list[str] = option(
        [],
        "workers=1,2,4,8 bandwidth=100mbit,1gbit,10gbit: a table over both, the "
        "crossover bandwidth of every profiled compressor, and a plot",
    )
    plot: str = option("plan_sweep.png", "where --sweep draws scaling efficiency against workers")
    json: bool = option(False, "print the plan as one JSON object")


def check_profile_model(cfg: PlanConfig, profile: Profile) -> None:
    if cfg.model is not None and cfg.model != profile.model:
        raise ConfigError(
            f"--profile {cfg.profile} measured {profile.model}, not --model {cfg.model}; profile "
            f"{cfg.model} with trainscale profile --model {cfg.model}"
        )


def compute_scale(cfg: PlanConfig, profile: Profile, device: str | None) -> tuple[float, str]:
    """Target device's step time over this machine's (1 when the plan is for this machine), and its origin."""
    if cfg.device_step_ms is not None:
        if cfg.device_step_ms <= 0:
            raise ConfigError(f"--device-step-ms must be positive, got {cfg.device_step_ms}")
        return cfg.device_step_ms / 1e3 / profile.compute_seconds, f"--device-step-ms {cfg.device_step_ms:g}"
    if device is None:
        return 1.0, f"profiled: {profile.device}, {profile.threads} thread(s)" + (
            f", {profile.cpus:g} CPUs" if profile.cpus else ""
        )
    target = load_device(device)
    seconds, figure = target.step_seconds(profile.model, profile.batch_size, profile.precision)
    origin = (
        f"{target.name}: {figure.images_per_sec:g} img/s at batch {figure.batch_size}, {figure.precision} "
        f"({figure.source})"
    )
    return seconds / profile.compute_seconds, origin


def setting_from(cfg: PlanConfig, profile: Profile) -> tuple[Setting, ClusterSpec | None, str]:
    """The Setting a plan describes, the cluster file it came from (if any), and where compute comes from."""
    spec = parse_spec(cfg.compress)
    if cfg.cluster and (cfg.hosts is not None or cfg.bandwidth is not None):
        raise ConfigError("give either --cluster or --hosts with --bandwidth, not both")
    if cfg.cluster:
        cluster = load_cluster(cfg.cluster)
        scale, origin = compute_scale(cfg, profile, cfg.device or cluster.device)
        return (
            Setting(
                cluster.hosts,
                cluster.devices_per_host,
                cluster.inter,
                cluster.intra,
                cfg.mode,
                spec,
                cfg.sync_every,
                cfg.servers,
                scale,
            ),
            cluster,
            origin,
        )
    if cfg.hosts is None:
        raise ConfigError("give --cluster NAME, or --hosts N with --bandwidth RATE (e.g. --hosts 4 --bandwidth 1gbit)")
    if cfg.hosts > 1 and cfg.bandwidth is None:
        raise ConfigError(f"--hosts {cfg.hosts} needs --bandwidth (the link rate between hosts, e.g. 1gbit)")
    inter = parse_link(cfg.bandwidth, cfg.latency) if cfg.bandwidth else None
    intra = parse_link(cfg.intra_bandwidth, "0us", "--intra-bandwidth")
    scale, origin = compute_scale(cfg, profile, cfg.device)
    return (
        Setting(cfg.hosts, cfg.workers_per_host, inter, intra, cfg.mode, spec, cfg.sync_every, cfg.servers, scale),
        None,
        origin,
    )


def with_bandwidth(setting: Setting, text: str) -> Setting:
    """The setting with its slow link (between hosts; on one host, between devices) at ``text``."""
    link = parse_link(text, "0us", "--sweep bandwidth")
    if setting.hosts > 1 or setting.inter is not None:
        base = setting.inter or link
        return replace(setting, inter=replace(base, bandwidth=link.bandwidth))
    base = setting.intra or link
    return replace(setting, intra=replace(base, bandwidth=link.bandwidth))
