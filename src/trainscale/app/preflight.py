"""The one pre-flight: every check that can run before any worker starts, in one order, with one result.

The dry run (``app.dryrun``), a run in this process (``commands.train``), the launcher on this machine
(``app.launch``) and the emulated-cluster launcher (``app.cluster_launch``) all run ``preflight``, so a dry run refuses
exactly what the run would, with the same line (a ConfigError or DataError: one line, exit 2). In order: the hosts
file (``--hosts``: the parent checks only that, each machine's launcher runs its own pre-flight); the
``--cluster`` (up, its namespaces there) and the mode's own checks again now that its hosts are known; the
devices and precision; the model's input size; on node 0 the ``--baseline`` and the run folder; the data, and a
full batch for every rank of the whole world.

``dry`` changes how, never what: nothing is written (the run folder is judged from permissions, not a probe
file) and nothing downloaded (the data must already be there). Left out, since they act on the world: the
rendezvous (it binds a port or waits for node 0: ``app.rendezvous``) and, with ``--hosts``, the other machines'
devices, data and run folder. Workers check again what they build (``app.run``), for an external torchrun.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainscale.app.config import TrainConfig
from trainscale.app.hosts import Host, parse_hosts
from trainscale.app.run import load_baseline
from trainscale.cluster.command import check_cluster
from trainscale.errors import ConfigError
from trainscale.modes import mode_class
from trainscale.train.precision import Precision, resolve_device, slow_bf16_note
from trainscale.train.setup import (
    BatchPlan,
    check_fits,
    check_model_input,
    check_run_folder,
    load_data,
    resolve_out,
    steps_per_epoch,
)
from trainscale.train.usermodel import check_model_on_data, user_code

log = logging.getLogger("trainscale")


@dataclass(frozen=True)
class Checked:
    """What the pre-flight resolved. ``hosts``: the machines of ``--hosts`` (then nothing else was checked);
    ``cluster``: the emulated cluster's record; ``out``: the run folder (node 0 only)."""

    cfg: TrainConfig
    hosts: list[Host] | None = None
    cluster: dict[str, Any] | None = None
    out: Path | None = None
    nodes: int = 1
    batch: BatchPlan | None = None
    train_samples: int = 0
    test_samples: int = 0

    @property
    def world_size(self) -> int:
        return self.cfg.launch.local_workers * self.nodes


def preflight(cfg: TrainConfig, dry: bool = False, data: bool = True) -> Checked:
    """Run every check on ``cfg`` (see the module's docstring); ``dry``: write and download nothing. ``data``
    False: a run in this process, which loads the data itself right after and checks it with the same
    ``check_fits``, so it is not loaded twice."""
    if cfg.launch.hosts is not None:
        hosts = parse_hosts(cfg.launch.hosts)
        return Checked(cfg, hosts=hosts, nodes=len(hosts))
    record = check_cluster(cfg.launch.cluster) if cfg.launch.cluster is not None else None
    if record is not None:  # the mode's checks again with the hosts known (``--inject-fault``'s replicas, say)
        cfg = cfg.replace(nnodes=record["hosts"], out=str(resolve_out(cfg)))
        mode_class(cfg.run.mode).validate(cfg)
    check_devices(cfg)
    check_model_input(cfg)
    out = resolve_out(cfg) if cfg.launch.node_rank == 0 else None
    if out is not None:  # node 0's first worker owns the run folder (and reads --baseline)
        load_baseline(cfg)
        check_run_folder(out, cfg.run.resume, cfg.replace(dry_run=False), probe=not dry)
    if not data:
        return Checked(cfg, cluster=record, out=out, nodes=cfg.launch.nnodes)
    n_train, n_test = sample_counts(cfg, download=not dry)
    workers = cfg.launch.local_workers * cfg.launch.nnodes
    batch = check_fits(cfg, n_train, n_test, workers)
    mode_class(cfg.run.mode).check_steps(cfg, steps_per_epoch(n_train, workers, batch.per_worker))
    return Checked(
        cfg, cluster=record, out=out, nodes=cfg.launch.nnodes, batch=batch, train_samples=n_train, test_samples=n_test
    )


def check_devices(cfg: TrainConfig) -> None:
    """GPUs, precision, backend and the mode's device needs against what this machine has."""
    if cfg.launch.devices:
        if not torch.cuda.is_available():
            raise ConfigError("--devices/--gpus needs CUDA GPUs and this machine has none; use --workers N on the CPU")
        if max(cfg.launch.devices) >= torch.cuda.device_count() or cfg.run.device == "cpu":
            raise ConfigError(
                f"--devices {','.join(map(str, cfg.launch.devices))}: this machine has "
                f"{torch.cuda.device_count()} GPU(s) and --device is {cfg.run.device}"
            )
    device = torch.device("cuda") if cfg.launch.devices else resolve_device(cfg.run.device)
    Precision(cfg.run.precision, device)
    slow = slow_bf16_note(cfg.run.precision, device)
    if slow:
        log.warning("%s", slow)  # once, before any worker starts
    if cfg.launch.backend == "nccl" and device.type != "cuda":
        raise ConfigError("--backend nccl needs CUDA devices; use gloo (the default) on the CPU")
    mode_class(cfg.run.mode).check_device(cfg, device)


def sample_counts(cfg: TrainConfig, download: bool) -> tuple[int, int]:
    """Both splits' sizes, the data loaded once here (verified, and downloaded when ``download`` and allowed), so
    the workers find it ready; synthetic images are made at 1x1 pixel, since only their number matters here,
    unless a model given by import path is checked against them (``usermodel.check_model_on_data``)."""
    size = 1 if cfg.data.dataset == "synthetic" and not user_code(cfg) else cfg.data.image_size
    train, test = load_data(cfg.replace(download=cfg.data.download and download, image_size=size))
    check_model_on_data(cfg, train, mode_class(cfg.run.mode).uses_servers)
    return len(train), len(test)
