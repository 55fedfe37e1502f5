"""One grid run's folder: is it done, half done, or holding something else? And its generated config.

A folder is reused only when it provably holds this run: ``bench.json`` (written by the runner before
the run starts) must carry the same config hash, and ``config.json`` (written by the run itself) must
equal the planned config (a key it lacks, written by an older trainscale, counts as its default).
Anything else is a ``RunFolderError`` before any run starts, never a silent mix.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import Path
from typing import Any

from trainscale.bench.expand import HASH_EXCLUDE, RunSpec, defaults
from trainscale.errors import ConfigError
from trainscale.io import atomic_write_text, dumps
from trainscale.io import to_toml as io_to_toml
from trainscale.record import SUMMARY, finished
from trainscale.results import LAUNCHER_FILES

MARKER, RUN_TOML, LOG, ERROR = LAUNCHER_FILES  # what train accepts in a new run's folder


class RunFolderError(ConfigError):
    """A run folder holds a different run than the grid plans for it."""


class State(Enum):
    TODO = "todo"
    RESUME = "resume"  # a checkpoint of this run exists: continue it, bit for bit
    DONE = "done"


# What `train --cluster` sets on each node, recorded in its config.json: one node per host and the threads
# of the host's CPU share.
CLUSTER_SETS = frozenset({"nnodes", "threads"})


def folder_state(folder: Path, spec: RunSpec) -> State:
    """Where this run stands; raises when the folder holds anything but this run."""
    if not folder.exists():
        return State.TODO
    _check_marker(folder, spec)
    _check_config(folder, spec)
    summary = _read(folder / SUMMARY)
    if summary and finished(summary, spec.config["epochs"]):
        return State.DONE
    return State.RESUME if (folder / "checkpoint.pt").exists() else State.TODO


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RunFolderError(f"{path} is unreadable ({exc}); move the folder away to re-run it") from None


def _check_marker(folder: Path, spec: RunSpec) -> None:
    marker = _read(folder / MARKER)
    if marker is None:
        if any(folder.iterdir()):
            raise RunFolderError(f"{folder} holds files not written by `trainscale bench`; move it away")
        return
    if marker.get("config_hash") != spec.config_hash:
        raise RunFolderError(
            f"{folder} holds a run with config hash {marker.get('config_hash')}, the grid plans "
            f"{spec.config_hash}; results of different settings are never mixed: move it away"
        )


def _check_config(folder: Path, spec: RunSpec) -> None:
    written = _read(folder / "config.json")
    if written is None:
        return
    known = defaults()
    ignored = HASH_EXCLUDE | (CLUSTER_SETS if spec.config.get("cluster") else frozenset())
    differ = sorted(
        k for k, v in spec.config.items() if k not in ignored and not _same(written.get(k, known.get(k, _MISSING)), v)
    )
    if differ:
        shown = ", ".join(f"{k}: {written.get(k, 'absent')!r} vs {spec.config[k]!r}" for k in differ[:4])
        raise RunFolderError(f"{folder}/config.json differs from the planned run ({shown}); move it away")


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def write_run_files(folder: Path, spec: RunSpec, resume: bool) -> Path:
    """``bench.json`` (the marker) and ``run.toml`` (what `trainscale train --config` reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / MARKER, dumps(spec.record()))
    values = {**spec.config, "progress": False, "resume": resume}
    path = folder / RUN_TOML
    atomic_write_text(path, f"# written by `trainscale bench` for run {spec.run_id}; do not edit\n" + to_toml(values))
    return path


def to_toml(values: dict[str, Any]) -> str:
    """Flat TOML for `trainscale train --config`: None is left out (every None is a default)."""
    return io_to_toml(values)
