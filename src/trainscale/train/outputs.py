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
import math
from pathlib import Path
from typing import Any

from trainscale.train.checkpoint import atomic_write_text

EPOCH_FIELDS = ("epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_seconds",
                "eval_seconds", "elapsed_seconds", "samples_per_sec", "peak_memory_mb")
SUMMARY_FIELDS = ("model", "params", "dataset", "mode", "world_size", "epochs", "batch_size", "best_test_acc",
                  "final_test_acc", "mean_epoch_seconds", "samples_per_sec", "peak_memory_mb",
                  "total_train_seconds", "time_to_target_seconds", "environment")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: store them as null so every reader can parse the files."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dumps(obj: Any) -> str:
    return json.dumps(_clean(obj), indent=2, sort_keys=False) + "\n"


class RunWriter:
    """Writes one run folder; only the main process owns one."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.history: list[dict[str, Any]] = []

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_text(self.out / "config.json", dumps(config))

    def restore_history(self, last_epoch: int) -> None:
        """On resume keep the epochs the checkpoint covers and drop any written after it."""
        path = self.out / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        self.history = [r for r in rows if r["epoch"] <= last_epoch]
        self._write_history()

    def add_epoch(self, row: dict[str, Any]) -> None:
        self.history.append(_clean(row))
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


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
