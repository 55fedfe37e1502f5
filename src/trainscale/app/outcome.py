"""What a finished distributed job prints: the run folder's epoch table and summary, and one line on its
communication, as `trainscale train` prints them for a local run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainscale.app.config import TrainConfig
from trainscale.console import EPOCH_COLUMNS, format_summary, format_table
from trainscale.modes.ps.stats import summary_line as ps_summary_line
from trainscale.record import SUMMARY, K
from trainscale.results import read_history, read_json


def report(cfg: TrainConfig, out: Path | None) -> None:
    """Print what the run folder ``out`` says (None: this node has none, node 0 does)."""
    if out is None:
        print(f"node {cfg.launch.node_rank}: all workers finished; the run folder is on node 0")
        return
    summary = read_json(out / SUMMARY)
    history = read_history(out)
    print(format_table(history, EPOCH_COLUMNS))
    print(format_summary(summary))
    print(comm_line(summary))
    print(f"results in {out}")


def comm_line(summary: dict[str, Any]) -> str:
    if summary.get(K.servers):  # parameter-server modes
        return ps_summary_line(summary)
    sent = summary.get(K.bytes_sent_per_step)
    calls = summary.get(K.allreduce_calls_per_step)
    text = f"{summary.get(K.mode)} over {summary.get(K.backend)}, world size {summary.get(K.world_size)}"
    if summary.get(K.sync_every):
        text += f", averaging every {summary[K.sync_every]} steps (outer lr {summary.get(K.outer_lr):g})"
    if sent is not None:
        text += f": {sent / 2**20:.2f} MiB handed to collectives per worker per step in {calls:.3g} call(s)"
    if summary.get(K.scaling_efficiency) is not None:
        text += f"; scaling efficiency {100 * summary[K.scaling_efficiency]:.1f}% vs --baseline"
    return text
