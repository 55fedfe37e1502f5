"""`trainscale train --dry-run`: the pre-flight, then the resolved config; nothing is written.

Beyond ``build_config`` (types, values, the mode's own checks) it runs the very pre-flight the run starts with
(``app.preflight``, with ``dry``: the run folder checked but never created, no probe file; the data must already
be there, never downloaded), so it refuses exactly what the run would. Left out, as from every pre-flight: the
rendezvous (it binds a port or waits for node 0) and, with ``--hosts``, the other machines' devices, data and
run folder.
"""

from __future__ import annotations

from typing import Any

from trainscale.app.config import TrainConfig
from trainscale.app.preflight import Checked, preflight
from trainscale.errors import ConfigError


def dry_run(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved config with what the checks worked out (``resolved``); the first problem found is a
    one-line ConfigError or DataError, as the real run would give."""
    try:
        checked = preflight(cfg, dry=True)
    except OSError as exc:  # a path the file system refuses outright, e.g. a name too long
        where = ascii(exc.filename)[:80] if exc.filename else "a path"
        raise ConfigError(f"{where}: {exc.strerror or type(exc).__name__}") from None
    return {**cfg.to_dict(), "resolved": resolved(checked)}


def resolved(checked: Checked) -> dict[str, Any]:
    """What the pre-flight worked out, as the dry run prints it."""
    cfg = checked.cfg
    if checked.hosts is not None:
        return {"nodes": [h.name for h in checked.hosts], "checked": "settings, hosts file"}
    assert checked.batch is not None
    return {
        "out": str(checked.out) if checked.out is not None else None,
        "world_size": checked.world_size,
        "batch_per_worker": checked.batch.per_worker,
        "global_batch_size": checked.batch.global_batch,
        "lr": checked.batch.lr,
        "train_samples": checked.train_samples,
        "test_samples": checked.test_samples,
        "checked": "settings, devices, run folder, data"
        + (", baseline" if cfg.launch.baseline else "")
        + (", cluster" if checked.cluster is not None else ""),
    }
