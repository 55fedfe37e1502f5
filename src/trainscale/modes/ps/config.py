"""The parameter-server section of the configuration and its checks (``--mode async``, ``ps-sync``, ``ma``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from trainscale.compression.config import CompressionConfig
from trainscale.compression.spec import CompressionSpec
from trainscale.config import MAX_WAIT_S, CoreConfig, Section, option
from trainscale.errors import ConfigError
from trainscale.modes.ps.codec import push_refusal
from trainscale.runtime.faults import FaultConfig, check_fault_steps, check_link_down, injected_faults, job_processes

PS_MODES = ("async", "ps-sync", "ma")
DEFAULT_AVERAGE_EVERY = 4
AUTO = "auto"


@dataclass
class PSConfig(Section):
    """Server shards per node beside ``--workers``; ``staleness`` bounds ASGD (None: unbounded);
    ``average_every``: ma's period in steps (None: 4); ``async_momentum`` and ``staleness_lr``: ASGD's
    remedies for the momentum asynchrony adds and for stale gradients (see ``resolve_async_momentum``
    and ``server.staleness_scale``)."""

    TITLE: ClassVar[str] = "parameter server (--mode async, ps-sync, ma)"
    FOR: ClassVar[str] = "the parameter-server modes (--mode async, ps-sync or ma)"

    servers: int = option(0, "parameter-server shards per node, started beside --workers (same launcher)")
    staleness: int | None = option(
        None, "async: a worker more than K steps ahead of the slowest waits (default: unbounded)"
    )
    average_every: int | None = option(None, "ma: average the workers' parameters every STEPS steps (default 4)")
    async_momentum: str = option(
        AUTO,
        "async: the servers' SGD momentum. 'auto' (default): --momentum less the "
        "momentum W asynchronous workers add themselves, max(0, momentum - (1 - 1/W)) "
        "(Mitliagkas et al. 2016); a number in [0, 1) sets it as is",
    )
    staleness_lr: bool = option(
        True,
        "async: scale each pushed gradient by 1/(1 + its staleness), the updates "
        "applied since its worker pulled (Zhang et al. 2016; default on)",
    )
    warm_start_epochs: int = option(0, "train on the main worker alone for the first E epochs (default 0)")
    rpc_timeout: float = option(
        300.0, "seconds a push or pull may take before the worker stops with an error", at_most=MAX_WAIT_S
    )
    heartbeat_timeout: float = option(
        10.0,
        "seconds a worker may leave the servers' ping unanswered before they "
        "drop it (a hung worker) and hand its batches to the others",
        at_most=MAX_WAIT_S,
    )

    def validate(self) -> None:
        _require(self.staleness is None or self.staleness >= 0, f"--staleness must be >= 0 steps, got {self.staleness}")
        _require(
            self.average_every is None or self.average_every >= 1,
            f"--average-every must be a positive number of steps, got {self.average_every}",
        )
        parse_async_momentum(self.async_momentum)
        _require(self.rpc_timeout > 0, f"--rpc-timeout must be > 0 seconds, got {self.rpc_timeout}")
        _require(self.heartbeat_timeout > 0, f"--heartbeat-timeout must be > 0 seconds, got {self.heartbeat_timeout}")

    @classmethod
    def check_steps(cls, cfg: Any, steps_per_epoch: int) -> None:
        """Each injected fault within reach: a worker's steps (or a shard's pushes) can at most be every worker's
        batches of every epoch (a worker takes over dead workers' batches, and the main one trains alone in the
        warm-start epochs); ``--average-every`` within an epoch (each epoch ends with an average, so a longer period is
        never taken)."""
        every = cfg.ps.average_every
        _require(
            every is None or every <= steps_per_epoch,
            f"--average-every {every} is longer than an epoch ({steps_per_epoch} steps per worker) and every epoch "
            f"ends with an average; give --average-every 1..{steps_per_epoch}, or more data per worker",
        )
        workers = job_processes(cfg.launch) or 1
        check_fault_steps(cfg.faults, cfg.optim.total_steps(steps_per_epoch) * workers, "steps (pushes) in all")


def parse_async_momentum(text: str) -> float | None:
    """``--async-momentum``: None for 'auto', else the number; a ConfigError unless a number in [0, 1)."""
    if text.strip().lower() == AUTO:
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0.0 <= value < 1.0:  # also false for nan
        raise ConfigError(f"--async-momentum must be 'auto' or a number in [0, 1), got '{text}'")
    return value


def resolve_async_momentum(setting: str, momentum: float, workers: int) -> float:
    """The servers' momentum for ASGD with ``workers`` asynchronous workers.

    W workers applying gradients asynchronously behave like SGD with an implicit momentum of about
    1 - 1/W (Mitliagkas et al. 2016, "Asynchrony begets momentum"); 'auto' takes it off the explicit
    one, ``max(0, momentum - (1 - 1/W))``, so the total stays near ``momentum`` (0.9 with 2 workers:
    0.4; with 10 or more: 0). A number is used as is; one worker has no asynchrony (``momentum``).
    """
    value = parse_async_momentum(setting)
    if value is not None:
        return value
    implicit = 1.0 - 1.0 / max(workers, 1)
    return round(max(0.0, momentum - implicit), 12)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_ps(cfg: CoreConfig, ps: PSConfig, faults: FaultConfig, compression: CompressionConfig) -> None:
    """Parameter-server settings of a run whose mode is one of ``PS_MODES``, against the rest of ``cfg`` (their
    ranges: ``PSConfig.validate``)."""
    mode = cfg.run.mode
    _require(
        not cfg.optim.partial_last_epoch,
        f"--mode {mode} trains whole epochs (a worker's shard and the batches it takes over run to the epoch's end), "
        f"not --epochs {cfg.optim.epochs:g}: give a whole number",
    )
    _require(ps.servers >= 1, f"--mode {mode} needs --servers S >= 1 (parameter-server shards per node)")
    _require(ps.staleness is None or mode == "async", "--staleness bounds ASGD; use it with --mode async")
    _require(ps.average_every is None or mode == "ma", "--average-every is the period of --mode ma")
    explicit = parse_async_momentum(ps.async_momentum)
    _require(
        explicit is None or mode == "async",
        "--async-momentum sets ASGD's server momentum; use it with --mode async (ps-sync and ma use --momentum)",
    )
    _require(
        ps.staleness_lr or mode == "async",
        "--no-staleness-lr applies to --mode async (ps-sync and ma have no stale gradients)",
    )
    _require(
        0 <= ps.warm_start_epochs < cfg.optim.epochs,
        f"--warm-start-epochs must be in [0, epochs={cfg.optim.epochs}), got {ps.warm_start_epochs}",
    )
    validate_push_compression(compression, cfg.run.seed)
    validate_faults(cfg, ps, faults)


def validate_push_compression(compression: CompressionConfig, seed: int) -> None:
    """``--compress`` compresses the workers' pushes, unless the method only works through collectives."""
    spec = CompressionSpec.from_config(compression, seed)
    refusal = push_refusal(spec) if spec.enabled else None
    _require(refusal is None, refusal or "")
    _require(
        compression.dense_below is None,
        "--dense-below is for the collectives of sync, localsgd and diloco; parameter-server pushes compress "
        "each server shard's slice of the flat gradient",
    )


def validate_faults(cfg: CoreConfig, ps: PSConfig, faults: FaultConfig) -> None:
    """--inject-fault in a parameter-server job: kill or hang of a worker, once each, one of node 0's left alive;
    kill of a server shard, once each."""
    check_link_down(faults)
    workers = job_processes(cfg.launch)
    shards = None if workers is None else workers // (cfg.launch.workers or 1) * ps.servers
    seen: set[int] = set()
    killed: set[int] = set()
    for fault in injected_faults(faults):
        where = f"--inject-fault {fault.text}"
        _require(
            fault.kind != "link",
            f"{where}: link cuts need an emulated cluster's fault-tolerant sync job; "
            "parameter-server jobs take kill or hang",
        )
        if fault.server:
            _require(
                fault.kind == "kill",
                f"{where}: a server shard can be killed, not hung (a stopped server holds "
                "every worker for --rpc-timeout)",
            )
            _require(
                shards is None or fault.rank < shards,
                f"{where}: there are only {shards} server shard(s) (s0..s{(shards or 1) - 1})",
            )
            _require(fault.rank not in killed, f"{where}: shard {fault.rank} already dies in an earlier fault")
            killed.add(fault.rank)
            continue
        _require(
            workers is None or fault.rank < workers,
            f"{where}: there are only {workers} workers (0..{(workers or 1) - 1})",
        )
        _require(
            fault.rank not in seen,
            f"{where}: worker {fault.rank} already dies in an earlier fault (a dead worker is not restarted)",
        )
        seen.add(fault.rank)
    local = cfg.launch.workers or 1
    _require(
        not seen or len(seen & set(range(local))) < local,
        f"--inject-fault: every worker of node 0 ({', '.join(map(str, range(local)))}) would die, and the run "
        "folder is there; leave one alive",
    )
