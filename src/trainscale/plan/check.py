"""The planner checked against measured runs: a run folder's config and summary become the Setting it ran
in (emulated cluster, mode, compressor), a matching profile predicts its step, and the two are compared.

A profile matches a run when it measured the same model, per-worker batch and precision with the threads
and CPU quota each emulated host had; a run with no matching profile is skipped (and listed), never
predicted from a profile taken under other conditions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from trainscale.compression.config import CompressionConfig
from trainscale.compression.spec import CompressionSpec
from trainscale.modes.localsgd import DEFAULT_SYNC_EVERY
from trainscale.plan.costs import Link
from trainscale.plan.methods import MethodSpec
from trainscale.plan.predict import MODES, Prediction, Setting, predict
from trainscale.plan.profile import Profile
from trainscale.record import K

COMPRESSION_KEYS = (
    "compress",
    "method",
    "granularity",
    "ratio",
    "threshold",
    "qstates",
    "qsgd_bucket",
    "powersgd_rank",
    "dense_below",
)


@dataclass
class Check:
    """One run: what it measured per step beside what the planner predicts for it."""

    run: str
    setting: Setting
    measured_step: float
    measured_comm: float | None
    predicted: Prediction
    profile: Profile

    @property
    def error(self) -> float:
        """Signed relative error of the predicted step time (positive: the planner is slower than the run)."""
        return self.predicted.step_seconds / self.measured_step - 1.0


def method_spec(config: dict[str, Any]) -> MethodSpec:
    """The compressor a run used, as the profile names it (a rounding seed is no part of its cost)."""
    section = CompressionConfig(**{k: config[k] for k in COMPRESSION_KEYS if config.get(k) is not None})
    return CompressionSpec.from_config(section)  # no seed: the profile's key leaves it out


def setting_for_run(config: dict[str, Any], summary: dict[str, Any]) -> Setting | None:
    """The Setting an emulated-cluster run ran in, or None (not on an emulated cluster, or a mode the planner
    does not model)."""
    cluster = summary.get(K.cluster) or {}
    mode = str(summary.get(K.mode) or config.get("mode"))
    if not cluster.get("hosts") or mode not in MODES:
        return None
    rate = min(cluster.get("rates_bps") or [cluster["rate_bps"]])
    link = Link(rate / 8.0, (cluster.get("rtt_seconds") or 0.0) / 2)
    sync_every = config.get("sync_every") or (DEFAULT_SYNC_EVERY if mode in ("localsgd", "diloco") else 1)
    return Setting(
        int(cluster["hosts"]),
        int(config.get("workers") or 1),
        link,
        None,
        mode,
        method_spec(config),
        int(sync_every),
        int(config.get("servers") or 1),
        batch_size=int(summary[K.batch_per_worker]),
    )


def profile_key(model: str, batch: int, precision: str, threads: int | None, cpus: float | None) -> tuple[Any, ...]:
    return model, int(batch), precision, threads, None if cpus is None else round(float(cpus), 3)


def key_of_profile(p: Profile) -> tuple[Any, ...]:
    return profile_key(p.model, p.batch_size, p.precision, p.threads, p.cpus)


def key_of_run(summary: dict[str, Any]) -> tuple[Any, ...]:
    cluster = summary.get(K.cluster) or {}
    return profile_key(
        str(summary.get(K.model)),
        int(summary.get(K.batch_per_worker) or 0),
        str(summary.get(K.precision)),
        cluster.get("threads_per_process"),
        cluster.get("cpus_per_host"),
    )


def check_run(
    name: str, config: dict[str, Any], summary: dict[str, Any], profiles: dict[tuple[Any, ...], Profile]
) -> Check | None:
    """The run beside its prediction, or None when it cannot be predicted (no cluster, no profile, no timing)."""
    setting = setting_for_run(config, summary)
    profile = profiles.get(key_of_run(summary))
    if setting is None or profile is None or not summary.get(K.step_seconds):
        return None
    if not setting.spec.dense and setting.spec.text not in profile.compressors:
        return None
    setting = replace(setting, **profile.measured_costs())  # measured on the machine the run ran on: used
    return Check(
        name,
        setting,
        float(summary[K.step_seconds]),
        summary.get(K.comm_seconds_per_step),
        predict(profile, setting),
        profile,
    )


def mean_absolute_error(checks: list[Check]) -> float:
    return sum(abs(c.error) for c in checks) / len(checks) if checks else float("nan")
