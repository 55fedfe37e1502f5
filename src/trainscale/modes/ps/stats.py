"""What the parameter server measures, and how per-shard and per-worker figures combine.

Servers count, per applied shard update: its staleness (how many updates the shard applied between
the pushing worker's pull and this push), the clock gap (how many steps the pushing worker was ahead
of the slowest active worker when it was allowed to go on), and the seconds spent in the update
itself. Workers count their own push/pull/wait seconds and payload bytes. Every figure is a plain
sum or maximum, so epochs and shards merge by adding.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from trainscale.record import K


@dataclass
class ServerStats:
    """One shard's counters since the last reset."""

    updates: int = 0
    pushes: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    staleness_hist: Counter = field(default_factory=Counter)
    clock_gap_max: int = 0
    update_seconds: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0

    def record_push(self, staleness: int, nbytes: int) -> None:
        self.pushes += 1
        self.bytes_in += nbytes
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        self.staleness_hist[staleness] += 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "updates": self.updates,
            "pushes": self.pushes,
            "staleness_sum": self.staleness_sum,
            "staleness_max": self.staleness_max,
            "staleness_hist": dict(self.staleness_hist),
            "clock_gap_max": self.clock_gap_max,
            "update_seconds": self.update_seconds,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }


def merge_server_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum of shard counters (maxima for the maxima, histograms added bin by bin)."""
    out: dict[str, Any] = {
        "updates": 0,
        "pushes": 0,
        "staleness_sum": 0,
        "staleness_max": 0,
        "staleness_hist": {},
        "clock_gap_max": 0,
        "update_seconds": 0.0,
        "bytes_in": 0,
        "bytes_out": 0,
        "dead_workers": [],
        "batches_committed": 0,
    }
    for part in parts:
        out["dead_workers"] = sorted(set(out["dead_workers"]) | set(part.get("dead_workers", [])))
        out["batches_committed"] += part.get("batches_committed", 0)  # server 0's ledger (see handover.py)
        for key in ("updates", "pushes", "staleness_sum", "update_seconds", "bytes_in", "bytes_out"):
            out[key] += part[key]
        for key in ("staleness_max", "clock_gap_max"):
            out[key] = max(out[key], part[key])
        for bin_, count in part["staleness_hist"].items():
            out["staleness_hist"][int(bin_)] = out["staleness_hist"].get(int(bin_), 0) + count
    out["staleness_hist"] = dict(sorted(out["staleness_hist"].items()))
    return out


@dataclass
class WorkerStats:
    """One worker's step-time split and traffic since the last reset (seconds are wall-clock)."""

    steps: int = 0
    push_seconds: float = 0.0
    pull_seconds: float = 0.0
    wait_seconds: float = 0.0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pushes: int = 0
    dense_bytes_pushed: int = 0  # what the same pushes would have carried as fp32 (the compression ratio's base)

    FIELDS = (
        "steps",
        "push_seconds",
        "pull_seconds",
        "wait_seconds",
        "bytes_pushed",
        "bytes_pulled",
        "pushes",
        "dense_bytes_pushed",
    )

    def as_list(self) -> list[float]:
        return [float(getattr(self, k)) for k in self.FIELDS]

    def reset(self) -> None:
        for k in self.FIELDS:
            setattr(self, k, type(getattr(self, k))())


def epoch_row(server: dict[str, Any], workers: dict[str, float], epoch_seconds: float, servers: int) -> dict[str, Any]:
    """The per-epoch figures of metrics.jsonl from merged server counters and summed worker counters.

    ``updates`` counts shard updates (one push is applied once by each of the ``servers`` shards), so
    full-model pushes are ``pushes / servers``; staleness figures are over shard updates. ``bytes_per_push`` is
    what a worker's push carried over all shards, measured (compressed payloads when pushes are compressed);
    ``compression_ratio`` is, as in sync mode, the dense fp32 bytes over those sent.
    """
    pushes = server["pushes"] / max(servers, 1)
    steps = max(workers["steps"], 1.0)
    sent, dense, pushed = workers.get("bytes_pushed", 0), workers.get("dense_bytes_pushed", 0), workers.get("pushes", 0)
    return {
        K.ps_pushes: pushes,
        K.pushes_per_sec: pushes / epoch_seconds if epoch_seconds > 0 else 0.0,
        K.staleness_mean: server["staleness_sum"] / server["pushes"] if server["pushes"] else 0.0,
        K.staleness_max: server["staleness_max"],
        K.staleness_hist: server["staleness_hist"],
        K.clock_gap_max: server["clock_gap_max"],
        K.dead_workers: server["dead_workers"],
        K.batches_committed: server["batches_committed"],
        K.server_update_seconds: server["update_seconds"],
        K.server_update_seconds_per_update: server["update_seconds"] / server["updates"] if server["updates"] else 0.0,
        K.bytes_pushed_per_step: workers["bytes_pushed"] / steps,
        K.bytes_pulled_per_step: workers["bytes_pulled"] / steps,
        K.bytes_per_push: sent / pushed if pushed else None,
        K.dense_bytes_per_push: dense / pushed if pushed else None,
        K.compression_ratio: dense / sent if sent and dense else None,
        K.push_seconds_per_step: workers["push_seconds"] / steps,
        K.pull_seconds_per_step: workers["pull_seconds"] / steps,
        K.wait_seconds_per_step: workers["wait_seconds"] / steps,
        K.comm_seconds_per_step: (workers["push_seconds"] + workers["pull_seconds"] + workers["wait_seconds"]) / steps,
    }


def summary_line(summary: dict[str, Any]) -> str:
    """One line for the console after a parameter-server run."""
    text = (
        f"{summary.get(K.ps_rule)} through {summary.get(K.servers)} server shard(s) over RPC, "
        f"{summary.get(K.workers)} worker(s)"
    )
    if summary.get(K.pushes_per_sec) is not None:
        text += (
            f": {summary[K.pushes_per_sec]:.1f} pushes/s, staleness mean {summary[K.staleness_mean]:.2f} max "
            f"{summary[K.staleness_max]}, {summary[K.bytes_pushed_per_step] / 2**20:.2f} MiB pushed + "
            f"{summary[K.bytes_pulled_per_step] / 2**20:.2f} MiB pulled per worker step"
        )
    method = summary.get(K.compress_method) or "none"
    if method != "none" and summary.get(K.bytes_per_push):
        ratio = summary.get(K.compression_ratio)
        text += f"; {method} pushes of {summary[K.bytes_per_push]:,.0f} bytes"
        text += f" ({ratio:.1f}x less than fp32)" if ratio else ""
    return text
