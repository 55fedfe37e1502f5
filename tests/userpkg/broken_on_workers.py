"""A model module that imports in the launching process but not in a worker (as when a worker's machine lacks a
library): it raises ImportError under torch's launcher."""

from __future__ import annotations

import os

if "LOCAL_RANK" in os.environ:
    raise ImportError("No module named 'fancy_layers' (only the launching machine has it)")

from tests.userpkg.nets import tiny  # noqa: E402,F401
