"""Live metrics: every ``--log-every`` steps, one row of the loss, learning rate, throughput and step time.

The hot loop stays free of host work: the loss is already summed on the device by the epoch's ``Accumulator``; a row
reads that sum once (the only device sync, every N steps) and takes the difference from the previous row. Rows go
to the run folder's ``steps.jsonl`` through the run's writer (``results.RunWriter.add_steps``) and, when the output
is not a terminal (a log file, a pipe, a notebook), as one plain log line each, in place of the progress bar.
Only the main process keeps a ``StepLog``; its loss is its own shard's, its throughput is scaled to the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from trainscale.record import StepK

log = logging.getLogger("trainscale.train")


class DeviceSums(Protocol):
    """What a row reads from the epoch's accumulator (``loop.Accumulator``)."""

    loss_sum: torch.Tensor
    count: int


class StepLog:
    """Rows every ``every`` steps of an epoch and at its last step; ``sink`` takes each row (the writer's
    ``add_steps``; None: no file), ``lines``: log each row as a plain line too."""

    def __init__(
        self, every: int, workers: int, sink: Callable[[dict[str, Any]], None] | None, lines: bool = False
    ) -> None:
        self.every, self.workers, self.sink, self.lines = every, workers, sink, lines
        self.epoch, self.steps = 0, 0
        self.sums: DeviceSums | None = None
        self._samples = 0
        self._since = (0.0, 0, 0.0, 0, 0)  # loss sum, counted samples, time, samples, step at the previous row

    def start_epoch(self, epoch: int, steps: int, sums: DeviceSums, started: float) -> None:
        """Before the epoch's first step: ``started`` is its device-synchronised start time."""
        self.epoch, self.steps, self.sums = epoch, steps, sums
        self._since = (0.0, 0, started, 0, 0)
        self._samples = 0

    def after_step(self, step: int, samples: int, lr: float) -> None:
        """After step ``step`` (0-based) of ``samples`` images at ``lr``: a row at every N-th and the last."""
        self._samples += samples
        if (step + 1) % self.every == 0 or step + 1 == self.steps:
            self.row(step, lr)

    def row(self, step: int, lr: float) -> dict[str, Any]:
        assert self.sums is not None  # start_epoch came first
        loss_sum = float(self.sums.loss_sum)  # the one device sync of the row
        now = time.perf_counter()
        prev_sum, prev_count, prev_time, prev_samples, prev_step = self._since
        counted, steps, seconds = self.sums.count - prev_count, step + 1 - prev_step, max(now - prev_time, 1e-9)
        row: dict[str, Any] = {
            StepK.step: self.epoch * self.steps + step + 1,
            StepK.epoch: self.epoch + 1,
            StepK.loss: (loss_sum - prev_sum) / counted if counted else None,
            StepK.lr: lr,
            StepK.samples_per_sec: (self._samples - prev_samples) * self.workers / seconds,
            StepK.step_seconds: seconds / steps,
        }
        self._since = (loss_sum, self.sums.count, now, self._samples, step + 1)
        if self.sink is not None:
            self.sink(row)
        if self.lines:
            loss = "-" if row[StepK.loss] is None else f"{row[StepK.loss]:.4f}"
            log.info(
                "epoch %d step %d/%d: loss %s, lr %.4g, %.0f img/s, %.1f ms/step",
                self.epoch + 1,
                step + 1,
                self.steps,
                loss,
                lr,
                row[StepK.samples_per_sec],
                1e3 * row[StepK.step_seconds],
            )
        return row
