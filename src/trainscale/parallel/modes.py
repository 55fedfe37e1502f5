"""Training modes by name. A mode owns the process group's life and how the model is wrapped;
the trainer is the same for all of them."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from trainscale.registry import Registry


class Mode:
    """Local training: one process, no communication. Subclasses add a process group and a wrapper.

    ``distributed`` modes run in worker processes started by torch.distributed.run: `trainscale train`
    starts the launcher for them unless it already runs under one.
    """

    name = "local"
    distributed = False

    def worker_device(self, requested: torch.device) -> torch.device:
        """The device this process trains on (distributed modes map CUDA to ``cuda:LOCAL_RANK``)."""
        return requested

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """Set up (and always tear down) whatever the mode needs for the run."""
        yield

    def wrap_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model

    def role_runner(self, device: torch.device) -> Callable[[], tuple[dict[str, Any], list[dict[str, Any]]]] | None:
        """What this process runs instead of training, for modes whose processes are not all trainers
        (a parameter server's shards, a worker's supervisor); None: train. Returns (summary, rows)."""
        return None

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer the training loop steps (parameter-server modes: one that pushes and pulls)."""
        return optimizer

    def wrap_batches(self, train: Any, test: Any) -> tuple[Any, Any]:
        """The training and test batches the trainer iterates (parameter-server modes: warm-start epochs,
        evaluation of the whole test set on the main worker)."""
        return train, test

    def before_train_epoch(self, epoch: int) -> None:
        """Called before each epoch's training pass (e.g. to step a compression warm-up schedule)."""

    def after_train_epoch(self, model: nn.Module) -> None:
        """Called after each epoch's training pass, before evaluation and the checkpoint (e.g. to make
        per-worker state such as BatchNorm running statistics identical on every rank)."""

    def epoch_stats(self) -> dict[str, Any]:
        """Mode-specific per-epoch figures (e.g. bytes on the wire), merged into metrics.jsonl."""
        return {}

    def run_stats(self) -> dict[str, Any]:
        """Mode-specific whole-run figures, merged into summary.json."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Static facts about the mode for summary.json (backend, BatchNorm handling, ...)."""
        return {"backend": None}


MODES: Registry[Mode] = Registry("mode")


@MODES.register("local")
def local(**_: Any) -> Mode:
    return Mode()


def create_mode(name: str, **kwargs: Any) -> Mode:
    """``kwargs`` (e.g. ``cfg=TrainConfig``) go to the mode's factory; factories ignore what they don't use."""
    return MODES.create(name, **kwargs)


def list_modes() -> list[str]:
    return MODES.names()


# Built-in modes register themselves on import; they import this module, so this comes last.
import trainscale.parallel.sync  # noqa: E402,F401
import trainscale.parallel.ps  # noqa: E402,F401  (async, ps-sync, ma)
