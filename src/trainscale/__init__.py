"""trainscale: train image classifiers on one process, many processes and many machines, and measure it.

``trainscale.fit(...)`` trains from Python (see ``trainscale.api``); it is imported on first use, so
``import trainscale`` loads nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["FitResult", "fit"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("trainscale.api"), name)
    raise AttributeError(f"module 'trainscale' has no attribute {name!r}")
