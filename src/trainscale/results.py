"""The run folder: the contract that reports, benchmarks and later tools read.

- ``config.json``: the resolved configuration.
- ``metrics.jsonl``: one JSON object per finished epoch (see ``EPOCH_FIELDS``).
- ``summary.json``: the run's result (see ``SUMMARY_FIELDS``), rewritten after every epoch.
- ``logs.tsv``: DAWNBench format: epoch, hours of training, top-1 test accuracy in percent.
- ``checkpoint.pt``: the last finished epoch (see ``checkpoint.py``).
Accuracies in the JSON files are fractions in 0..1; every file is replaced atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainscale.io import atomic_write_text, clean, dumps, read_json, read_jsonl

EPOCH_FIELDS = ("epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_seconds",
                "eval_seconds", "elapsed_seconds", "samples_per_sec", "peak_memory_mb")
SUMMARY_FIELDS = ("model", "params", "dataset", "mode", "world_size", "epochs", "batch_size", "best_test_acc",
                  "final_test_acc", "mean_epoch_seconds", "samples_per_sec", "peak_memory_mb",
                  "total_train_seconds", "time_to_target_seconds", "environment")

# Files a launcher of runs (``trainscale bench``) writes into a run folder before the run starts; a folder
# holding only these is still a new run's folder.
LAUNCHER_FILES = ("bench.json", "run.toml", "train.log", "error.txt")


class RunWriter:
    """Writes one run folder; only the main process owns one."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.history: list[dict[str, Any]] = []
        for debris in self.out.glob(".*.tmp"):  # a write killed mid-way (see io.atomic_write_bytes)
            debris.unlink(missing_ok=True)

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_text(self.out / "config.json", dumps(config))

    def restore_history(self, last_epoch: int) -> None:
        """On resume keep the epochs the checkpoint covers and drop any written after it."""
        path = self.out / "metrics.jsonl"
        rows = read_jsonl(path) if path.exists() else []
        self.history = [r for r in rows if r["epoch"] <= last_epoch]
        self._write_history()

    def add_epoch(self, row: dict[str, Any]) -> None:
        self.history.append(clean(row))
        self._write_history()

    def _write_history(self) -> None:
        lines = "".join(json.dumps(r) + "\n" for r in self.history)
        atomic_write_text(self.out / "metrics.jsonl", lines)
        tsv = ["epoch\thours\ttop1Accuracy"] + [
            f"{r['epoch']}\t{r['elapsed_seconds'] / 3600:.8f}\t{100 * (r['test_acc'] or 0):.2f}" for r in self.history
        ]
        atomic_write_text(self.out / "logs.tsv", "\n".join(tsv) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.out / "summary.json", dumps(summary))


def read_history(out: Path) -> list[dict[str, Any]]:
    """The per-epoch rows of a run folder (a torn last line tolerated, see ``io.read_jsonl``)."""
    path = Path(out) / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


__all__ = ["EPOCH_FIELDS", "LAUNCHER_FILES", "SUMMARY_FIELDS", "RunWriter", "dumps", "read_history", "read_json"]
