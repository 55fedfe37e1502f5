"""Which process am I: the job description, built once at a process's entry and passed down.

A trainscale job is several processes: the launcher the user started, torch's elastic agents, workers,
parameter-server shards and supervisors, fault-tolerant replicas and their agents, nodes of an emulated
cluster. A launcher tells the processes it starts who they are through their environment (the only channel
into a process torch's agent starts); ``Job.from_environ`` reads that channel once, at the entry
(``trainscale.commands``, and a spawned parameter-server trainer's entry in ``app.run``), and below it code
takes the ``Job`` it is given. Nothing else reads an internal ``TRAINSCALE_*`` variable
(tests/unit/test_job.py). The names below are the channel's vocabulary: the launchers write them.

Code that no caller can hand a job to (a fault log line deep in the parameter server, a config check of a
node of an emulated cluster) asks ``this_job()`` for the job the entry installed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the launcher's channel to the processes it starts (internal: set by trainscale, never by users)
LAUNCHER_PID_ENV = "TRAINSCALE_LAUNCHER_PID"  # the launcher or agent whose death ends this process
REPLICA_ENV = "TRAINSCALE_FT_REPLICA"  # this replica's index in a fault-tolerant job, 0..replicas-1
REPLICAS_ENV = "TRAINSCALE_FT_REPLICAS"
BARRIER_ENV = "TRAINSCALE_FT_BARRIER"  # host:port of the fault-tolerant launcher's start-barrier store
EVENTS_ENV = "TRAINSCALE_FT_EVENTS"  # the job's fault log (JSON lines)
OWNER_ENV = "TRAINSCALE_FT_LAUNCHER_PID"  # the launcher that holds the run folder's lock
TEMP_ENV = "TRAINSCALE_FT_TEMP"  # the fault-tolerant launcher's temporary folder, where its replicas keep theirs
REFUSAL_ENV = "TRAINSCALE_REFUSAL"  # where a worker tells its launcher it refuses to go on (app.failures.refuse_job)
ADDRESS_ENV = "TRAINSCALE_FT_ADDRESS"  # where this node's replicas listen (127.0.0.1 on one machine)
NODE_ENV = "TRAINSCALE_NODE_RANK"  # the node (emulated host) a fault-tolerant replica runs on
NODE_REPORT_ENV = "TRAINSCALE_NODE_REPORT"  # where a node writes its failure for `train --cluster`
CLUSTER_ENV = "TRAINSCALE_CLUSTER"  # the facts of the emulated cluster a job runs on, as JSON
FAULT_ENV = "TRAINSCALE_FAULT"  # test-only: a worker fault (``runtime.faults``)
PS_SLOW_ENV = "TRAINSCALE_PS_SLOW"  # test-only: a slowed parameter-server worker (``modes.ps.optimizer``)

LOCAL, LAUNCHED, REPLICA_AGENT, REPLICA = "local", "worker", "replica agent", "replica"
TORCH_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Job:
    """This process's place in its job. The defaults describe a process the user started (a local run, or
    a launcher before it starts anything)."""

    rank: int = 0
    local_rank: int = 0
    world: int = 1
    local_world: int = 0  # processes the agent started on this node; 0 when none did
    group_rank: int | None = None  # torch's node index, where an agent says
    restarts: int = 0  # how often the agent restarted this process's workers
    master: tuple[str, int] | None = None  # the attempt's store address (MASTER_ADDR, MASTER_PORT)
    launched: bool = False  # started by torch's elastic agent or torchrun (its variables are all set)
    node: int = 0  # the node (emulated host) a fault-tolerant replica runs on
    launcher_pid: int | None = None  # the launcher or agent that started this process; it dies with it
    owner_pid: int | None = None  # a fault-tolerant job's launcher, which holds the run folder's lock
    replica: int | None = None  # this replica's index in a fault-tolerant job; None outside one
    replicas: int = 1
    barrier: str | None = None  # host:port of the replicas' start barrier
    address: str | None = None  # where this node's replicas listen
    fault_log: Path | None = None  # the job's fault log (fault-tolerant and parameter-server jobs)
    refusal: Path | None = None  # where a worker says it refuses to go on, where restarts would meet it again
    temp_root: Path | None = None  # where a fault-tolerant replica keeps its temporary folder (its launcher's)
    node_report: Path | None = None  # where this node reports its failure to `train --cluster`
    cluster: dict[str, Any] | None = field(default=None, hash=False, compare=False)  # emulated cluster's facts
    fault: str = ""  # test-only fault injection (``runtime.faults``)
    ps_slow: str = ""  # test-only slowdown of a parameter-server worker

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> Job:
        """The job as the launcher's environment ``env`` describes it (the entry passes ``os.environ``)."""
        master = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
        group = env.get("GROUP_RANK", "")
        cluster = env.get(CLUSTER_ENV)
        return cls(
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world=_int(env, "WORLD_SIZE", 1),
            local_world=_int(env, "LOCAL_WORLD_SIZE", 0),
            group_rank=int(group) if group.isdigit() else None,
            restarts=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            master=(master[0], int(master[1])) if master[0] and master[1].isdigit() else None,
            launched=all(v in env for v in TORCH_LAUNCH_VARS),
            node=_int(env, NODE_ENV, 0),
            launcher_pid=_optional_int(env, LAUNCHER_PID_ENV),
            owner_pid=_optional_int(env, OWNER_ENV),
            replica=_optional_int(env, REPLICA_ENV),
            replicas=_int(env, REPLICAS_ENV, 1),
            barrier=env.get(BARRIER_ENV) or None,
            address=env.get(ADDRESS_ENV) or None,
            fault_log=_path(env, EVENTS_ENV),
            refusal=_path(env, REFUSAL_ENV),
            temp_root=_path(env, TEMP_ENV),
            node_report=_path(env, NODE_REPORT_ENV),
            cluster=json.loads(cluster) if cluster else None,
            fault=env.get(FAULT_ENV, ""),
            ps_slow=env.get(PS_SLOW_ENV, ""),
        )

    @property
    def role(self) -> str:
        """``local`` (started by the user), ``worker`` (started by an agent), ``replica agent`` (the agent of
        one fault-tolerant replica) or ``replica`` (its worker). A parameter-server mode splits its workers
        further into trainers, supervisors and server shards by local rank (``modes.ps``)."""
        if self.replica is not None:
            return REPLICA if self.launched else REPLICA_AGENT
        return LAUNCHED if self.launched else LOCAL

    @property
    def by_trainscale(self) -> bool:
        """Started by `trainscale train`'s launcher (which prints the results), not by the user or torchrun."""
        return self.launcher_pid is not None

    @property
    def settings_said(self) -> bool:
        """Whether a trainscale launcher above this process has said the run's notes: it started this worker, or
        this node of an emulated cluster, which it gave every resolved setting as a flag (so each reads as given)."""
        return self.by_trainscale or self.node_report is not None

    @property
    def folder_holders(self) -> tuple[int, ...]:
        """The processes of this job that may hold the run folder's lock: the launchers above this one."""
        return tuple(pid for pid in (self.launcher_pid, self.owner_pid) if pid is not None)

    @property
    def writes_folder_first(self) -> bool:
        """Whether this process, if it is its group's main process, creates the run folder: not a replica other
        than replica 0 (the replicas share one), not a restarted attempt (the folder is the job's already)."""
        return self.replica in (None, 0) and self.restarts == 0

    @property
    def cluster_name(self) -> str | None:
        return self.cluster["name"] if self.cluster else None


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else default


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.isdigit() else None


def _path(env: Mapping[str, str], name: str) -> Path | None:
    value = env.get(name)
    return Path(value) if value else None


_installed = Job()


def install(job: Job) -> None:
    """Make ``job`` this process's job (the entry, once); ``this_job()`` answers it from then on."""
    global _installed
    _installed = job


def this_job() -> Job:
    """The job the entry installed (a plain local process until one does)."""
    return _installed


@contextlib.contextmanager
def installed(job: Job) -> Iterator[Job]:
    """``job`` as this process's job for the block, then the one before (tests, tools that act for a job)."""
    before = this_job()
    install(job)
    try:
        yield job
    finally:
        install(before)
