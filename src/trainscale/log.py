"""stdlib logging with the rank in every line, so interleaved worker output stays readable."""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Configure the ``trainscale`` logger once per process; the rank comes from the launcher's env."""
    rank = os.environ.get("RANK", "0")
    logger = logging.getLogger("trainscale")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter(f"rank {rank}"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def _formatter(who: str) -> logging.Formatter:
    return logging.Formatter(FORMAT.format(who=who), datefmt="%H:%M:%S")


def relabel(who: str) -> None:
    """Name this process differently in its log lines: the launcher's parent is not a rank (on node 1
    it would otherwise claim to be rank 0)."""
    for handler in logging.getLogger("trainscale").handlers:
        handler.setFormatter(_formatter(who))
