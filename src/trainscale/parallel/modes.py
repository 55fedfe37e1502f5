"""Training modes by name. A mode owns the process group's life and how the model is wrapped;
the trainer is the same for all of them."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from trainscale.registry import Registry


class Mode:
    """Local training: one process, no communication. Subclasses add a process group and a wrapper."""

    name = "local"

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """Set up (and always tear down) whatever the mode needs for the run."""
        yield

    def wrap_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model

    def epoch_stats(self) -> dict[str, Any]:
        """Mode-specific per-epoch figures (e.g. bytes on the wire), merged into metrics.jsonl."""
        return {}


MODES: Registry[Mode] = Registry("mode")


@MODES.register("local")
def local(**_: Any) -> Mode:
    return Mode()


def create_mode(name: str, **kwargs: Any) -> Mode:
    return MODES.create(name, **kwargs)


def list_modes() -> list[str]:
    return MODES.names()
