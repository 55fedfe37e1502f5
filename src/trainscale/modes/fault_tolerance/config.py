"""The fault-tolerance section of the config (``--fault-tolerance``, ``--ft-timeout``; ``cfg.replication``) and its
checks against the rest of the config, fault injection's included. A data-parallel mode takes it by listing the
section in its ``sections``; the checks run with the mode's (``Mode.validate`` runs each section's
``check_section``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from trainscale.config import MAX_WAIT_S, Section, option
from trainscale.errors import ConfigError
from trainscale.runtime import ft
from trainscale.runtime.faults import (
    InjectedFault,
    check_fault_steps,
    check_link_down,
    injected_faults,
    job_processes,
    on_cluster,
)
from trainscale.runtime.job import this_job


@dataclass
class ReplicationConfig(Section):
    """Per-step fault tolerance: each worker a torchft replica (``modes.fault_tolerance``)."""

    TITLE: ClassVar[str] = "data parallel (sync mode)"

    fault_tolerance: bool = option(
        False,
        "per-step fault tolerance (torchft): each worker is a replica; a dead one "
        "costs at most the step in flight, survivors go on, it is restarted and heals "
        "from a peer (--max-restarts per replica; 0 means 5)",
    )
    ft_timeout: float = option(
        5.0,
        "with --fault-tolerance: seconds a step's all-reduce waits for a silent peer "
        "before the step is dropped and the quorum goes on without it",
        above=0,
        at_most=MAX_WAIT_S,
    )

    @classmethod
    def check_section(cls, cfg: Any) -> None:
        """``--link-down`` always; the rest when fault tolerance or an injected fault is asked for."""
        check_link_down(cfg.faults)
        if cfg.replication.fault_tolerance or cfg.faults.inject_fault:
            validate_fault_tolerance(cfg)

    @classmethod
    def check_steps(cls, cfg: Any, steps_per_epoch: int) -> None:
        """Each injected fault within the job's committed steps (every replica takes ``steps_per_epoch`` an epoch)."""
        if cfg.replication.fault_tolerance:
            check_fault_steps(cfg.faults, cfg.optim.total_steps(steps_per_epoch), "committed steps")


FT_MODES = ("sync", "localsgd", "diloco")


def validate_fault_tolerance(cfg: Any) -> None:
    """--fault-tolerance and --inject-fault against the rest of the config (one ConfigError line). Under
    ``--cluster`` the parent knows the hosts only once it has read the cluster: it checks again with ``nnodes``
    set to them (``app.preflight``), so replica numbers are bounded there."""
    if cfg.faults.inject_fault and not cfg.replication.fault_tolerance:
        raise ConfigError("--inject-fault needs --fault-tolerance (a plain sync job stops at the first dead worker)")
    if cfg.run.mode not in FT_MODES:
        raise ConfigError(f"--fault-tolerance works with --mode {', '.join(FT_MODES)}, not {cfg.run.mode}")
    if cfg.optim.partial_last_epoch:
        raise ConfigError(
            f"--fault-tolerance trains whole epochs (its replicas walk each epoch to its end), not --epochs "
            f"{cfg.optim.epochs:g}: give a whole number"
        )
    ft.require_torchft()
    if cfg.run.precision == "fp16":
        raise ConfigError(
            "--fault-tolerance needs --precision bf16 or fp32 (fp16's grad scaler may skip a step on one replica only)"
        )
    if cfg.launch.nnodes > 1 and not cfg.run.out:
        raise ConfigError(
            "--fault-tolerance on several machines needs --out, the same folder on a file system "
            "every machine shares (any replica may take over writing the run)"
        )
    for fault in injected_faults(cfg.faults):
        validate_injected(fault, cfg)


def validate_injected(fault: InjectedFault, cfg: Any) -> None:
    """One --inject-fault against the job's replicas (``workers`` per node) and, for a link cut, its cluster."""
    workers, replicas = cfg.launch.workers or 1, job_processes(cfg.launch)
    what = f"--inject-fault {fault.text}"
    if fault.server:
        raise ConfigError(
            f"{what}: s{fault.rank} names a parameter-server shard; a fault-tolerant job has replicas "
            "only (give a replica's number)"
        )
    if replicas is not None and fault.rank >= replicas:
        raise ConfigError(f"{what}: there are only {replicas} replicas (0..{replicas - 1})")
    if fault.kind != "link":
        return
    if not (cfg.launch.cluster or on_cluster(this_job())):
        raise ConfigError(
            f"{what} cuts a host's link on an emulated cluster: run with --cluster NAME "
            "(trainscale cluster up), or use kill or hang"
        )
    if fault.rank < workers:
        raise ConfigError(
            f"{what}: replica {fault.rank} is on host 0, whose link carries the lighthouse every "
            f"replica needs; cut another host's (replicas {workers}..)"
        )
