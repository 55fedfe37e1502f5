"""Repeats into groups, groups into environments, and scaling efficiency against the 1-worker group.

- Environment: runs measured on a different device or torch (``ENV_KEYS``) go to separate partitions,
  each with its own tables and plots; numbers from two machines are never averaged together.
- Group: runs whose configs are equal except ``seed`` and plumbing (``GROUP_EXCLUDE``) are repeats of
  one configuration: shown as mean and spread (sample standard deviation).
- Scaling efficiency: ``trainscale.train.scaling.scaling_efficiency`` of each run against the mean
  throughput of the 1-worker group with the same model, dataset, precision, image size and per-worker
  batch (weak scaling); when several qualify, the one whose config is closest.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainscale.bench.expand import HASH_EXCLUDE, significant
from trainscale.modes.ps.config import PS_MODES
from trainscale.record import SAME_CONFIG, K, scaling_efficiency, throughput
from trainscale.report.collect import RunRecord

ENV_KEYS = ("device_name", "torch")
GROUP_EXCLUDE = HASH_EXCLUDE | {"seed", "baseline", "data_dir"}


@dataclass
class Stat:
    """Mean and spread over a group's runs (``stdev`` is 0 for a single run); None when no run has it."""

    values: list[float]

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else 0.0

    def text(self, fmt: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
        if self.mean is None:
            return "-"
        mean = format(self.mean * scale, fmt)
        spread = f" ± {format(self.stdev * scale, fmt)}" if len(self.values) > 1 else ""
        return f"{mean}{spread}{suffix}"


@dataclass
class Group:
    """Repeats of one configuration in one environment."""

    label: str
    key: str
    runs: list[RunRecord]
    efficiency: list[float] = field(default_factory=list)
    baseline: str = ""

    @property
    def first(self) -> RunRecord:
        return self.runs[0]

    def summary(self, name: str, default: Any = None) -> Any:
        return self.first.summary.get(name, default)

    def config(self, name: str, default: Any = None) -> Any:
        return self.first.config.get(name, default)

    def stat(self, measure: Callable[[RunRecord], float | None]) -> Stat:
        values = [measure(r) for r in self.runs]
        return Stat([float(v) for v in values if v is not None])

    @property
    def world_size(self) -> int:
        return int(self.summary(K.world_size) or 1)


@dataclass
class Partition:
    """The groups measured in one environment."""

    environment: dict[str, Any]
    groups: list[Group]
    runs: list[RunRecord]


def env_key(record: RunRecord) -> tuple[str, ...]:
    return tuple(str(record.environment.get(k)) for k in ENV_KEYS)


def group_key(record: RunRecord) -> str:
    """Canonical config without seed and plumbing (from config.json; summary fields when it is absent)."""
    config = record.config or {k: v for k, v in record.summary.items() if k not in (K.environment, K.out)}
    return json.dumps(significant(config, GROUP_EXCLUDE), sort_keys=True, default=str)


def partitions(records: list[RunRecord]) -> list[Partition]:
    """Finished runs by environment, then by configuration; efficiency filled in."""
    by_env: dict[tuple[str, ...], list[RunRecord]] = {}
    for record in (r for r in records if r.ok):
        by_env.setdefault(env_key(record), []).append(record)
    result = [Partition(runs[0].environment, _groups(runs), runs) for runs in by_env.values()]
    for part in result:
        add_efficiency(part.groups)
    return result


def _groups(runs: list[RunRecord]) -> list[Group]:
    groups: dict[str, Group] = {}
    for record in runs:
        key = group_key(record)
        if key not in groups:
            groups[key] = Group(record.label, key, [])
        groups[key].runs.append(record)
    _unique_labels(list(groups.values()))
    return list(groups.values())


def _unique_labels(groups: list[Group]) -> None:
    """Two configurations with one label (e.g. the same row name in two grids) get their grid or folder."""
    counts: dict[str, int] = {}
    for group in groups:
        counts[group.label] = counts.get(group.label, 0) + 1
    for group in groups:
        if counts[group.label] > 1:
            group.label = f"{group.label} ({group.first.grid or group.first.folder.parent.name})"


def run_throughput(record: RunRecord) -> float | None:
    """Training images/s over all workers (steady state when there are several epochs)."""
    try:
        return throughput(record.summary)
    except (ValueError, TypeError, ZeroDivisionError):
        return None


def add_efficiency(groups: list[Group]) -> None:
    for group in groups:
        base = find_baseline(group, groups)
        if base is None:
            continue
        mean = base.stat(run_throughput).mean
        if not mean:
            continue
        reference: dict[str, Any] = {K.samples_per_sec: mean, K.world_size: base.world_size}
        group.efficiency = [scaling_efficiency(r.summary, reference) for r in group.runs if run_throughput(r)]
        group.baseline = base.label


def find_baseline(group: Group, groups: list[Group]) -> Group | None:
    """The 1-worker group this one scales from (itself when it has one worker)."""
    if group.world_size == 1:
        return group
    wanted = {k: group.summary(k) for k in (*SAME_CONFIG, K.batch_per_worker)}
    candidates = [g for g in groups if g.world_size == 1 and all(g.summary(k) == v for k, v in wanted.items())]
    return max(candidates, key=lambda g: _similarity(group, g), default=None)


def _similarity(a: Group, b: Group) -> int:
    return sum(1 for k, v in a.first.config.items() if b.first.config.get(k) == v)


def uses_parameter_server(group: Group) -> bool:
    return group.config("mode", group.summary(K.mode)) in PS_MODES or bool(group.config("servers"))
