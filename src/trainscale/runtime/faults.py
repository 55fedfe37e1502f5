"""TEST-ONLY fault injection for the failure and restart tests: never set this in real runs.

``TRAINSCALE_FAULT=ACTION:rank=R:epoch=E:step=S`` makes global rank R (``rank=any``: every rank that has the
variable, as the one node of a multi-node job given it, whatever rank it was given), on the first attempt only
(TORCHELASTIC_RESTART_COUNT 0 or unset), do ACTION just before step S (0-based) of epoch E (1-based,
as in metrics.jsonl): ``kill`` sends itself SIGKILL (a crashed or OOM-killed worker), ``raise`` raises
a RuntimeError (a bug), ``refuse`` a ConfigError (a refusal that a restart would meet again, as a full disk).
A restarted worker never fires again, so a run with --max-restarts can finish.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from trainscale.config import LaunchConfig, Section, option
from trainscale.errors import ConfigError
from trainscale.runtime.cluster import cut_link
from trainscale.runtime.ft import job_events, log_event
from trainscale.runtime.job import FAULT_ENV, NODE_ENV, Job  # noqa: F401  (NODE_ENV: the launcher writes it)

log = logging.getLogger("trainscale.runtime")

ENV_VAR = FAULT_ENV
ACTIONS = ("kill", "raise", "refuse")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int | None  # None: any rank
    epoch: int
    step: int

    def fire(self) -> None:
        log.warning(
            "%s: injecting '%s' in rank %d at epoch %d step %d", ENV_VAR, self.action, self.rank, self.epoch, self.step
        )
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        where = f"in rank {self.rank} at epoch {self.epoch} step {self.step}"
        if self.action == "refuse":
            raise ConfigError(f"{ENV_VAR}: injected refusal {where}")
        raise RuntimeError(f"{ENV_VAR}: injected failure {where}")


def parse_fault(text: str) -> Fault:
    """``kill:rank=1:epoch=2:step=3`` -> Fault; anything else is a ConfigError naming the format."""
    action, *pairs = text.split(":")
    try:
        fields = dict(p.split("=", 1) for p in pairs)
        rank = fields.pop("rank")
        fault = Fault(action, None if rank == "any" else int(rank), int(fields.pop("epoch")), int(fields.pop("step")))
    except (ValueError, KeyError):
        fault, fields = None, {}
    if fault is None or fields or action not in ACTIONS:
        raise ConfigError(
            f"{ENV_VAR}='{text}': expected ACTION:rank=R:epoch=E:step=S with ACTION in {', '.join(ACTIONS)}"
        )
    return fault


def fault_for(rank: int, job: Job) -> Fault | None:
    """The fault this rank must inject in this attempt of ``job``, if any."""
    text = job.fault
    if not text or job.restarts > 0:
        return None
    fault = parse_fault(text)
    return replace(fault, rank=rank) if fault.rank in (None, rank) else None


class FaultyBatches:
    """Wraps a training batch iterator and fires ``fault`` at its epoch and step."""

    def __init__(self, inner: Any, fault: Fault) -> None:
        self.inner = inner
        self.fault = fault

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def epoch(self, epoch: int) -> Iterator[Any]:
        return self._firing(self.inner.epoch(epoch), epoch)

    def lazy_epoch(self, epoch: int) -> Iterator[Any]:
        """The batches as a fault-tolerant replica walks them (``ReplicaBatches``)."""
        return self._firing(self.inner.lazy_epoch(epoch), epoch)

    def _firing(self, batches: Iterator[Any], epoch: int) -> Iterator[Any]:
        for step, batch in enumerate(batches):
            if epoch + 1 == self.fault.epoch and step == self.fault.step:
                self.fault.fire()
            yield batch


def with_fault_injection(batches: Any, rank: int, job: Job) -> Any:
    fault = fault_for(rank, job)
    return FaultyBatches(batches, fault) if fault else batches


# ------------------------------------------------------------------ --inject-fault (fault-tolerant runs)

FAULT_KINDS = ("kill", "hang", "link")
FAULT_FORMAT = "KIND:RANK@STEP (KIND kill, hang or link; RANK a worker, or sN for server shard N; e.g. kill:1@20)"
DEFAULT_LINK_DOWN_S = 5.0


_FIRING = threading.Lock()
_FIRED: set[InjectedFault] = set()


@dataclass(frozen=True)
class InjectedFault:
    """``--inject-fault``: replica ``rank`` meets ``kind`` in the job's step ``step`` (1-based, counted in
    committed steps), after its backward, as the step's exchange starts: ``kill`` sends itself SIGKILL (a crash),
    ``hang`` SIGSTOP (a process that stops answering; the launcher's watchdog kills it once the others have dropped
    it), ``link`` takes its host's cable out of an emulated cluster's switch for ``--link-down`` seconds (a network
    partition: the process lives on, cut off, and rejoins once the link is back). ``server``: ``rank`` is a
    parameter-server shard (written ``sN``) and ``step`` the push it dies at."""

    kind: str
    rank: int
    step: int
    server: bool = False

    @property
    def text(self) -> str:
        """The fault as ``--inject-fault`` writes it."""
        return f"{self.kind}:{'s' if self.server else ''}{self.rank}@{self.step}"

    def fire(self, link_down_s: float = 0.0, job: Job | None = None, **fields: Any) -> None:
        """Log the fault (with ``fields``) in the job's fault log, then meet it; a link is cut on ``job``'s
        cluster, at its node (the emulated host this process runs on). Once per process: a server's RPC threads
        may reach the same push count together, and the second must not log a second fault while the first is
        killing the process."""
        with _FIRING:
            if self in _FIRED:
                return
            _FIRED.add(self)
            self._meet(link_down_s, job, **fields)

    def _meet(self, link_down_s: float, job: Job | None, **fields: Any) -> None:
        log.warning("--inject-fault %s fires", self.text)
        if self.kind == "link":
            job = job or Job()
            log_event(
                "fault",
                kind=self.kind,
                rank=self.rank,
                step=self.step,
                host=job.node,
                down_seconds=link_down_s,
                **fields,
            )
            cut_link(cluster_name(job), job.node, link_down_s)
            return
        log_event("fault", kind=self.kind, rank=self.rank, step=self.step, server=self.server, **fields)
        os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)


def on_cluster(job: Job) -> bool:
    """Whether ``job`` runs on an emulated cluster (where ``link`` faults can be met)."""
    return job.cluster is not None


def cluster_name(job: Job) -> str:
    if job.cluster_name is None:
        raise ConfigError(
            "--inject-fault link:... cuts a host's link on an emulated cluster; this job is not on "
            "one (train --cluster NAME)"
        )
    return job.cluster_name


def parse_injected_fault(text: str) -> InjectedFault:
    """``kill:1@20`` (or ``kill:s0@20``, a server shard) -> InjectedFault; anything else is a ConfigError naming
    the format."""
    kind, _, rest = text.partition(":")
    rank, _, step = rest.partition("@")
    server = rank.startswith("s")
    rank = rank[1:] if server else rank
    if kind not in FAULT_KINDS or not rank.isdigit() or not step.isdigit() or int(step) < 1:
        raise ConfigError(f"--inject-fault '{text}': expected {FAULT_FORMAT}")
    return InjectedFault(kind, int(rank), int(step), server)


def not_yet_fired(faults: list[InjectedFault]) -> list[InjectedFault]:
    """``faults`` that no earlier attempt of the job has fired (its fault log says which did): a process restarted
    after one still meets its later faults and never repeats one."""
    done = {(e["kind"], e["rank"], e["step"], e.get("server", False)) for e in job_events() if e["event"] == "fault"}
    return [f for f in faults if (f.kind, f.rank, f.step, f.server) not in done]


@dataclass
class FaultConfig(Section):
    """``--inject-fault``: shared by the modes that survive a dead worker (sync under --fault-tolerance, the
    parameter-server modes), each of which checks it against its own rules."""

    TITLE: ClassVar[str] = "fault injection"

    inject_fault: list[str] | None = option(
        None,
        "faults to inject, KIND:RANK@STEP, comma-separated (kill = "
        "SIGKILL, hang = SIGSTOP), e.g. kill:1@20. Sync modes need "
        "--fault-tolerance (RANK: a replica, STEP: the job's committed "
        "steps); parameter-server modes: RANK is a worker, STEP its own steps, "
        "or sN a server shard, STEP its pushes (kill only). "
        "link = cut RANK's host off an emulated cluster (--cluster, "
        "--fault-tolerance) for --link-down seconds",
    )
    link_down: float = option(
        DEFAULT_LINK_DOWN_S,
        "seconds a link:... fault keeps the host's link down before it is plugged back in (at most an hour)",
        above=0,
        at_most=3600,
    )

    def validate(self) -> None:
        """Each fault well formed, ``--link-down`` only beside a link fault; the modes check them against the job."""
        check_link_down(self)


def injected_faults(cfg: FaultConfig) -> list[InjectedFault]:
    """``--inject-fault``'s faults (the flag's list items may hold several, comma-separated)."""
    return [parse_injected_fault(text.strip()) for item in cfg.inject_fault or [] for text in item.split(",")]


def check_link_down(cfg: FaultConfig) -> None:
    """``--link-down``: positive, and only beside a ``link:`` fault (alone it would be silently ignored)."""
    if cfg.link_down <= 0:
        raise ConfigError(f"--link-down must be a positive number of seconds, got {cfg.link_down}")
    if cfg.link_down != DEFAULT_LINK_DOWN_S and not any(f.kind == "link" for f in injected_faults(cfg)):
        raise ConfigError(
            "--link-down is how long a link:... fault keeps a host cut off; give one with "
            "--inject-fault link:RANK@STEP, or leave --link-down out"
        )


def check_fault_steps(cfg: FaultConfig, last_step: int, counted: str) -> None:
    """Every ``--inject-fault`` at a step the run reaches (``last_step``, in the steps ``counted`` names): a fault
    past the end would never fire, and the run would pass for one that met it."""
    for fault in injected_faults(cfg):
        if fault.step > last_step:
            raise ConfigError(
                f"--inject-fault {fault.text}: the run has only {last_step} {counted}, so step {fault.step} "
                f"never comes; give a step in 1..{last_step} or more --epochs"
            )


def job_processes(launch: LaunchConfig) -> int | None:
    """Workers (replicas) of the whole job, ``--workers`` per node: None in a ``--cluster`` parent that has not read
    its cluster yet (``app.preflight`` checks again with ``nnodes`` set to the hosts)."""
    return launch.processes()
