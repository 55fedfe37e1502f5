"""`trainscale train --dry-run`: every check that needs no training, then the resolved config; nothing is written.

Beyond ``build_config`` (types, values, the mode's own checks) it checks what the launcher's ``prepare``
checks, minus what would act on the world: the hosts file, the ``--cluster`` (up, its namespaces there), the devices and precision, the model's input
size, the ``--baseline``, the run folder (checked, never created: no probe file) and the data, which must already be there (never downloaded)
and give every rank a full batch. Left out: the rendezvous (it binds a port or waits for node 0) and,
with ``--hosts``, the other machines' devices, data and run folder.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainscale.app.cluster_run import check_cluster
from trainscale.app.config import TrainConfig
from trainscale.app.hosts import parse_hosts
from trainscale.app.launch import check_devices
from trainscale.app.run import load_baseline
from trainscale.errors import ConfigError
from trainscale.train.setup import (
    check_fits,
    check_model_input,
    check_run_folder,
    load_data,
    resolve_out,
)


def dry_run(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved config with what the checks worked out (``resolved``); the first problem found is a
    one-line ConfigError or DataError, as the real run would give."""
    try:
        return _checked(cfg)
    except OSError as exc:  # a path the file system refuses outright, e.g. a name too long
        where = ascii(exc.filename)[:80] if exc.filename else "a path"
        raise ConfigError(f"{where}: {exc.strerror or type(exc).__name__}") from None


def _checked(cfg: TrainConfig) -> dict[str, Any]:
    if cfg.hosts is not None:
        hosts = parse_hosts(cfg.hosts)
        return {**cfg.to_dict(), "resolved": {"nodes": [h.name for h in hosts], "checked": "settings, hosts file"}}
    nodes = check_cluster(cfg.cluster)["hosts"] if cfg.cluster is not None else cfg.nnodes
    check_devices(cfg)
    check_model_input(cfg)
    out = resolve_out(cfg) if cfg.node_rank == 0 else None
    if out is not None:
        load_baseline(cfg)
        check_run_folder(out, cfg.resume, dataclasses.replace(cfg, dry_run=False), probe=False)
    n_train, n_test = sample_counts(cfg)
    world = cfg.workers * nodes
    plan = check_fits(cfg, n_train, n_test, world)
    resolved = {"out": str(out) if out is not None else None, "world_size": world,
                "batch_per_worker": plan.per_worker, "global_batch_size": plan.global_batch, "lr": plan.lr,
                "train_samples": n_train, "test_samples": n_test,
                "checked": "settings, devices, run folder, data" + (", baseline" if cfg.baseline else "") +
                (", cluster" if cfg.cluster else "")}
    return {**cfg.to_dict(), "resolved": resolved}


def sample_counts(cfg: TrainConfig) -> tuple[int, int]:
    """Both splits' sizes from the data already on disk (never downloaded); synthetic images are made at
    1x1 pixel, since only their number matters here."""
    size = 1 if cfg.dataset == "synthetic" else cfg.image_size
    train, test = load_data(dataclasses.replace(cfg, download=False, image_size=size))
    return len(train), len(test)
