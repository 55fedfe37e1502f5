"""Scaling efficiency: how much of N workers' ideal speed-up a run achieved against a baseline run.

``efficiency = (throughput_N / N) / (throughput_B / B)``: 1.0 means perfect linear scaling; with a
1-worker baseline (B = 1) this is throughput_N / (N x throughput_1). Throughput is training images
per second over all workers. Steady-state throughput (epochs after the first, which carries warm-up)
is used when both runs have more than one epoch, else the whole-run figure.
"""

from __future__ import annotations

from typing import Any

# Fields two runs must share for their throughputs to be comparable.
SAME_CONFIG = ("model", "dataset", "precision", "image_size")


def throughput(summary: dict[str, Any]) -> float:
    """Training images/s of a run summary (steady state when available)."""
    steady = summary.get("steady_epoch_seconds")
    per_epoch = summary.get("train_samples_per_epoch")
    if steady and per_epoch:
        return per_epoch / steady
    value = summary.get("samples_per_sec")
    if not value:
        raise ValueError(f"summary of {summary.get('out')} has no throughput (no finished epoch?)")
    return float(value)


def scaling_efficiency(run_summary: dict[str, Any], baseline_summary: dict[str, Any]) -> float:
    """Per-worker throughput of ``run_summary`` over that of ``baseline_summary`` (usually 1 worker)."""
    n = int(run_summary.get("world_size") or 1)
    b = int(baseline_summary.get("world_size") or 1)
    return (throughput(run_summary) / n) / (throughput(baseline_summary) / b)


def config_mismatches(run_summary: dict[str, Any], baseline_summary: dict[str, Any]) -> list[str]:
    """Fields that differ between the runs (a non-empty list means the efficiency compares apples to pears)."""
    return [f"{k}: {baseline_summary.get(k)!r} vs {run_summary.get(k)!r}" for k in SAME_CONFIG
            if run_summary.get(k) != baseline_summary.get(k)]
