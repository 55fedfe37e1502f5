"""Time-dilated emulation: an emulated cluster whose links are slowed by as much as this machine's compute is
slower than the target's device, so a run on it has the target cluster's ratio of compute to communication.

The factor is this machine's step time (a profile of the model, taken with the CPUs one emulated host gets)
over the target device's step time for the same model and batch (its device file). Every link rate is
divided by it; every time a run measures, divided by it, is the target's (``projected`` in summary.json).
"""

from __future__ import annotations

from typing import Any

from trainscale.errors import ConfigError
from trainscale.plan.describe import load_cluster, load_device
from trainscale.plan.profile import load_profile
from trainscale.record import PROJECTED_TIMES, K
from trainscale.runtime import cluster as net
from trainscale.runtime.cpus import cpu_count


def dilated_rates(
    target: str, profile_path: str | None, hosts: int | None, bandwidth: str | None
) -> tuple[list[int], dict[str, Any]]:
    """The emulated cluster's rates (bit/s, one per host) and the dilation record for ``target``."""
    if profile_path is None:
        raise ConfigError("--dilate-to needs --profile P: this machine's profile of the model the runs will train")
    if bandwidth is not None:
        raise ConfigError("--dilate-to takes its links from the cluster file; leave out --bandwidth")
    spec = load_cluster(target)
    if hosts is not None and hosts != spec.hosts:
        raise ConfigError(f"--dilate-to {target} has {spec.hosts} hosts; leave out --hosts or give {spec.hosts}")
    if spec.hosts < net.MIN_HOSTS or spec.inter is None or not spec.device:
        raise ConfigError(f"--dilate-to {target}: needs at least {net.MIN_HOSTS} hosts, a [link.inter] and a device")
    profile = load_profile(profile_path)
    share = cpu_count() / spec.hosts
    if profile.cpus is None or abs(profile.cpus - share) > 1e-6:
        raise ConfigError(
            f"--profile {profile_path} was taken with {profile.cpus or 'all'} CPUs, but each of "
            f"{spec.hosts} emulated hosts gets {share:g}: profile again with --cpus {share:g}"
        )
    target_step, figure = load_device(spec.device).step_seconds(profile.model, profile.batch_size, profile.precision)
    factor = profile.compute_seconds / target_step
    rate = int(spec.inter.bandwidth * 8 / factor)
    if not net.MIN_RATE <= rate <= net.MAX_RATE:
        raise ConfigError(
            f"--dilate-to {target}: its {net.format_rate(int(spec.inter.bandwidth * 8))} links "
            f"dilated {factor:.3g}x would be {rate} bit/s, outside what tc shapes (8kbit-100gbit)"
        )
    text = (
        f"dilated to {spec.name}: this machine's {profile.model} step at batch {profile.batch_size} takes "
        f"{1e3 * profile.compute_seconds:.1f} ms against {1e3 * target_step:.1f} ms on a {spec.device} "
        f"({figure.source}), so every link runs {factor:.3g}x slower: "
        f"{net.format_rate(int(spec.inter.bandwidth * 8))} -> {net.format_rate(rate)}; train with --workers "
        f"{spec.devices_per_host} per host to match its {spec.devices_per_host} devices per host"
    )
    return [rate] * spec.hosts, {
        "target": spec.name,
        "factor": factor,
        "device": spec.device,
        "model": profile.model,
        "batch_size": profile.batch_size,
        "target_rate_bps": int(spec.inter.bandwidth * 8),
        "this_step_seconds": profile.compute_seconds,
        "target_step_seconds": target_step,
        "text": text,
    }


def projected(summary: dict[str, Any]) -> dict[str, Any]:
    """On a time-dilated emulated cluster (``cluster up --dilate-to``): the run's times divided by the
    dilation factor, its throughput multiplied by it: the target cluster's figures."""
    dilation = (summary.get(K.cluster) or {}).get("dilation")
    if not dilation:
        return {}
    factor = float(dilation["factor"])
    times = {k: summary[k] / factor for k in PROJECTED_TIMES if summary.get(k) is not None}
    rate = summary.get(K.samples_per_sec)
    return {
        K.projected: {
            "target": dilation["target"],
            "factor": factor,
            **times,
            "samples_per_sec": rate * factor if rate else None,
        }
    }
