"""Repeat-and-summarise timing shared by the benchmark scripts."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainscale.io import atomic_write_text, dumps
from trainscale.train.precision import synchronize


def mean_and_spread(values: list[float]) -> tuple[float, float]:
    """The mean of a benchmark's repeats and their spread (the sample standard deviation; 0 for one repeat)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class Timing:
    """Seconds per repeat; ``mean`` and ``stdev`` over the repeats (warm-up already excluded)."""

    seconds: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds)

    @property
    def stdev(self) -> float:
        return mean_and_spread(self.seconds)[1]

    def rate(self, items: int) -> tuple[float, float]:
        """Items per second: mean and spread (stdev) over repeats."""
        return mean_and_spread([items / s for s in self.seconds])


def paired_ratios(numerator: Timing, denominator: Timing) -> list[float]:
    """Repeat-by-repeat ratios of two interleaved timings: each pair ran back to back, so slow drift and
    background load cancel within a pair; their median is steadier than the ratio of two means."""
    return [a / b for a, b in zip(numerator.seconds, denominator.seconds)]


def time_interleaved(
    fns: dict[str, Callable[[], None]], repeats: int, warmup: int, device: torch.device
) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, round-robin so drift (thermal, other load) hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            out[name].append(time.perf_counter() - start)
    return {name: Timing(values) for name, values in out.items()}


def save_result(path: Path, result: dict[str, Any]) -> None:
    """Write a benchmark result (config, environment, figures) atomically as JSON."""
    atomic_write_text(Path(path), dumps(json.loads(json.dumps(result, default=_plain))))


def _plain(obj: Any) -> Any:
    if isinstance(obj, Timing):
        return {"seconds": obj.seconds, "mean": obj.mean, "stdev": obj.stdev}
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    return str(obj)
