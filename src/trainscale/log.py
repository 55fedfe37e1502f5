"""stdlib logging with the rank in every line, so interleaved worker output stays readable."""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Configure the ``trainscale`` logger once per process; the rank comes from the launcher's env."""
    rank = os.environ.get("RANK", "0")
    logger = logging.getLogger("trainscale")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
