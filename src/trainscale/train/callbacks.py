"""What a training mode adds around the engine's epochs, as one object the Trainer calls.

The engine knows nothing about modes: a mode (``trainscale.modes``) subclasses ``Callbacks`` and the
composition root hands it to the Trainer. Every method is a no-op here, so local training and tests
pass ``Callbacks()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from torch import nn


class Writes(enum.Enum):
    """Whether a process writes the run folder at an epoch's end (its main process holds a writer)."""

    NOT_NOW = "not now"
    ALONE = "alone"  # the folder's only writer
    SHARED = "shared"  # one of several that take turns (the one elected now; their writers are ``shared``)


class Callbacks:
    """Hooks around each epoch; see ``Trainer.run_epoch`` for the order they are called in."""

    def before_fit(self, snapshot: Callable[[], dict[str, Any]], restore: Callable[[dict[str, Any]], None]) -> None:
        """Once, before the first epoch, with functions that take and restore the trainer's whole state
        (model, optimizer, scaler, run state, the mode's own, the run's rows it knows): a mode that copies live
        state between workers (e.g. to heal a restarted one) keeps them."""

    def writes_run_folder(self) -> Writes:
        """Whether this process writes the run folder at this epoch's end. A mode whose writer may change during
        the run (it died; another process holds a writer too) says ``SHARED`` in the process elected now and
        ``NOT_NOW`` in the others, whose writers keep the row (``results.RunWriter``, ``shared``: it owns what a
        turn writes)."""
        return Writes.ALONE

    def before_train_epoch(self, epoch: int) -> None:
        """Before each epoch's training pass (e.g. to step a compression warm-up schedule)."""

    def after_train_epoch(self, model: nn.Module) -> None:
        """After each epoch's training pass, before evaluation and the checkpoint (e.g. to make per-worker
        state such as BatchNorm running statistics identical on every rank)."""

    def epoch_samples(self, counted: int) -> int:
        """The images the whole job trained on this epoch, given the count summed over this process group. A
        mode whose workers are worlds of their own (e.g. replicas that each count their own) counts them itself."""
        return counted

    def epoch_stats(self) -> dict[str, Any]:
        """Figures of the epoch (e.g. bytes on the wire), merged into its metrics.jsonl row."""
        return {}

    def run_stats(self) -> dict[str, Any]:
        """Whole-run figures, merged into summary.json."""
        return {}

    def derived_stats(self) -> list[Callable[[dict[str, Any]], dict[str, Any]]]:
        """Functions of the finished summary whose figures are merged into it last, when every other figure is
        there (e.g. an emulated cluster's times projected to the cluster it stands for)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """What the mode needs to resume bit for bit besides the model and optimizer (e.g. an outer
        optimizer's momentum); stored in each checkpoint as ``mode``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s value; called after the model and optimizer are restored."""


class Forwarding(Callbacks):
    """Callbacks that hand every hook to ``inner``: the base of a wrapper that adds to a few of them (the wire
    counter), so a hook it does not touch still reaches the mode (a wrapper that forgot ``before_fit`` once left
    a fault-tolerant replica without its state functions)."""

    def __init__(self, inner: Callbacks) -> None:
        self.inner = inner

    def before_fit(self, snapshot: Callable[[], dict[str, Any]], restore: Callable[[dict[str, Any]], None]) -> None:
        self.inner.before_fit(snapshot, restore)

    def writes_run_folder(self) -> Writes:
        return self.inner.writes_run_folder()

    def before_train_epoch(self, epoch: int) -> None:
        self.inner.before_train_epoch(epoch)

    def after_train_epoch(self, model: nn.Module) -> None:
        self.inner.after_train_epoch(model)

    def epoch_samples(self, counted: int) -> int:
        return self.inner.epoch_samples(counted)

    def epoch_stats(self) -> dict[str, Any]:
        return self.inner.epoch_stats()

    def run_stats(self) -> dict[str, Any]:
        return self.inner.run_stats()

    def derived_stats(self) -> list[Callable[[dict[str, Any]], dict[str, Any]]]:
        return self.inner.derived_stats()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
