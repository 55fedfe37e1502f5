"""`trainscale train` in a distributed mode: check everything, start the workers with torch's elastic
agent, and report as one job.

The parent process (what the user ran) never trains. It runs the pre-flight (``app.preflight``) and finds the
rendezvous (``app.rendezvous``), so every mistake it can see is one line and exit 2 before any worker exists.
Then ``torch.distributed.launcher.api.elastic_launch`` runs the agent: a c10d rendezvous (node 0 hosts it; on
one node a free port on 127.0.0.1), ``--workers`` copies of ``python -m trainscale train <the same flags>``
(``app.worker_env``) with RANK/WORLD_SIZE/... set, restarts up to ``--max-restarts`` times, and on a failure
stops every worker and raises ``ChildFailedError``, which becomes one line naming the failed rank and its error
(``app.failures``; workers are wrapped in ``@record`` so their exception reaches the agent). On success node 0
prints the table and summary from the run folder (``app.outcome``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainscale.app.config import TrainConfig
from trainscale.app.failures import describe_failure, root_traceback, write_node_report
from trainscale.app.ft_launch import DEFAULT_RESTARTS, Meeting, launch_replicas, record_ps_faults
from trainscale.app.outcome import report
from trainscale.app.preflight import preflight
from trainscale.app.rendezvous import bind_address, rendezvous_address, run_id
from trainscale.app.run import run_training
from trainscale.app.worker_env import fault_log_folder, logged_faults, worker_args, worker_env
from trainscale.log import relabel
from trainscale.record import SUMMARY, K
from trainscale.results import lock_run_folder, read_json
from trainscale.runtime import ft
from trainscale.runtime.cpus import oversubscription, threads_per_worker
from trainscale.runtime.job import Job, this_job
from trainscale.runtime.network import LOCALHOST, free_port
from trainscale.runtime.orphans import become_launcher, die_with_parent
from trainscale.runtime.rendezvous import register_backend
from trainscale.runtime.worker_errors import recorded

log = logging.getLogger("trainscale.launch")

MONITOR_INTERVAL_S = 0.1


@dataclass(frozen=True)
class LaunchPlan:
    """What the checks resolved: where to meet, who hosts, the run folder, threads per worker."""

    endpoint: str
    is_host: bool
    run_id: str
    out: Path | None
    threads: int
    logs: Path | None = None  # the agent's folder for the workers' error files (``job_temp_folder``)


@contextlib.contextmanager
def job_temp_folder() -> Iterator[Path]:
    """A folder of this launcher's, removed with it, for what a job would otherwise leave in the temporary folder:
    torch's elastic agent keeps its workers' error files in a folder it never removes (here: ``agent/``), and a
    worker stopped by a signal ends without Python's clean-up (``runtime.orphans``), so its own temporary files
    (the ``pymp-*`` folders of DataLoader workers) stay; the processes it starts get this folder as their TMPDIR,
    unless its path is too long for the Unix sockets made in it (then they keep the usual one). torch's compiler
    cache keeps its usual place, so compiled kernels are still reused across runs."""
    with tempfile.TemporaryDirectory(prefix="ts") as folder:
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_cache_dir()
        short = len(folder) <= SOCKET_FOLDER_MAX
        with environ({"TMPDIR": folder, "TORCHINDUCTOR_CACHE_DIR": cache} if short else {}):
            yield Path(folder)


# A Unix socket's path holds at most 107 bytes; multiprocessing puts its sockets 33 bytes deep into TMPDIR
# (pymp-XXXXXXXX/listener-XXXXXXXX), so a longer TMPDIR would make DataLoader workers fail.
SOCKET_FOLDER_MAX = 107 - 34


def inductor_cache_dir() -> str:
    """Where torch's compiler keeps its cache when no variable says: ``torchinductor_<user>`` in the temporary
    folder (torch's default, worked out here without importing the compiler)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


@contextlib.contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """This process's signal handlers as they were: torch's agent installs its own for SIGINT, SIGTERM, SIGHUP and
    SIGQUIT and leaves them, so a caller that goes on (``trainscale.fit`` in a notebook) would no longer get a
    KeyboardInterrupt on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in AGENT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (so in every process it starts) while the block runs."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launched_by_trainscale(job: Job) -> bool:
    """True in a worker whose parent is `trainscale train` (which prints the results itself)."""
    return job.by_trainscale


def prepare(cfg: TrainConfig) -> LaunchPlan:
    """The pre-flight (``app.preflight``: each failure one line, exit 2), then where this node meets the others."""
    checked = preflight(cfg)
    crowded = None if cfg.launch.devices else oversubscription(cfg.launch.local_workers + cfg.ps.servers)
    if crowded:
        log.warning("%s", crowded)  # once, by the launcher: the workers do not repeat it
    endpoint, is_host = rendezvous_address(cfg)
    return LaunchPlan(
        endpoint, is_host, run_id(cfg), checked.out, threads_per_worker(cfg.run.threads, cfg.launch.local_workers)
    )


def launch_config(cfg: TrainConfig, plan: LaunchPlan) -> LaunchConfig:
    """torch's LaunchConfig: fixed node count, torch's c10d rendezvous with its store bound to one address
    (``runtime.rendezvous``), a 0.1 s monitor so failures stop the job fast."""
    return LaunchConfig(
        min_nodes=cfg.launch.nnodes,
        max_nodes=cfg.launch.nnodes,
        nproc_per_node=cfg.launch.local_workers + cfg.ps.servers,
        run_id=plan.run_id,
        rdzv_backend=register_backend(),
        rdzv_endpoint=plan.endpoint,
        rdzv_configs={"is_host": plan.is_host, "join_timeout": int(cfg.launch.rdzv_timeout)},
        max_restarts=cfg.launch.max_restarts,
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
        local_addr=bind_address(plan.endpoint, plan.is_host),
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.logs)) if plan.logs is not None else None,
    )


def launch(cfg: TrainConfig, flags: dict[str, Any], job: Job | None = None) -> int:
    """Run the job (``job``: this launcher's place in it, by default the entry's); returns the exit status (0, 1
    for a failed worker, 2 for a user error in a worker)."""
    job = job or this_job()
    if job.replica is not None:
        return run_replica_agent(cfg, flags, job)
    plan = prepare(cfg)
    with fault_log_folder(cfg, plan.out) as fault_log, job_temp_folder() as temp, signal_handlers_kept():
        os.environ.update(worker_env(cfg, plan.threads, fault_log))
        return run_agents(cfg, flags, dataclasses.replace(plan, logs=temp / "agent"))


def run_agents(cfg: TrainConfig, flags: dict[str, Any], plan: LaunchPlan) -> int:
    """This node's part of the job under torch's elastic agent (or the fault-tolerant replicas' launchers)."""
    if cfg.replication.fault_tolerance:
        meeting = Meeting(plan.endpoint, plan.is_host, bind_address(plan.endpoint, plan.is_host), cfg.launch.nnodes)
        status = launch_replicas(cfg, worker_args(flags, plan.out), plan.out, meeting)
        if status == 0:
            report(cfg, plan.out)
        return status
    become_launcher(cfg.launch.max_restarts > 0)  # the workers die with this process, quietly (runtime.orphans)
    relabel(f"node {cfg.launch.node_rank} launcher")
    servers = f" and {cfg.ps.servers} parameter server(s)" if cfg.ps.servers else ""
    log.info(
        "starting %d worker(s)%s on node %d of %d (rendezvous %s, %d thread(s) each)",
        cfg.launch.workers,
        servers,
        cfg.launch.node_rank,
        cfg.launch.nnodes,
        plan.endpoint,
        plan.threads,
    )
    events = plan.out / ft.EVENTS_FILE if plan.out is not None and cfg.ps.servers else None
    try:
        with lock_run_folder(plan.out):  # for the whole job, restarts included: no second job writes there
            if events is not None and not cfg.run.resume and events.exists():
                events.unlink()
            elastic_launch(launch_config(cfg, plan), sys.executable)(*worker_args(flags, plan.out))
    except ChildFailedError as exc:
        message, status = describe_failure(exc.failures, cfg.launch.workers if cfg.ps.servers else None)
        write_node_report(exc.failures, message, status, this_job().node_report)
        trace = root_traceback(exc.failures)  # the workers leave it to this process (``worker_errors``)
        print(
            f"{trace}\ntrainscale train: error: {message}" if trace else f"trainscale train: error: {message}",
            file=sys.stderr,
        )
        return status
    except RendezvousError as exc:
        print(
            f"trainscale train: error: rendezvous at {plan.endpoint} failed: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    except SignalException as exc:  # Ctrl-C or a scheduler's SIGTERM: the agent has stopped the workers
        print(f"trainscale train: interrupted by {exc.sigval.name}; workers stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    if events is not None and plan.out is not None and (plan.out / SUMMARY).exists():
        record_ps_faults(plan.out, logged_faults(cfg))
        done = read_json(plan.out / SUMMARY).get(K.epochs_completed, 0)
        if done < cfg.optim.epochs:  # every worker died, each one survivable on its own
            print(
                f"trainscale train: error: every worker died; the run folder holds {done} of {cfg.optim.epochs} "
                "epoch(s); --resume continues from the last one",
                file=sys.stderr,
            )
            return 1
    report(cfg, plan.out)
    return 0


def run_replica_agent(cfg: TrainConfig, flags: dict[str, Any], job: Job) -> int:
    """One replica of a fault-tolerant job (``ft_launch``): torch's elastic agent with one worker, restarted
    alone when it dies (``--max-restarts`` times; 0 means ``DEFAULT_RESTARTS``), dying with the launcher."""
    die_with_parent(signal.SIGKILL, job.owner_pid)
    address = job.address or LOCALHOST
    assert cfg.run.out is not None  # a fault-tolerant job's --out is resolved before its replicas start
    plan = LaunchPlan(
        f"{address}:{free_port(address)}",
        True,
        uuid.uuid4().hex,
        Path(cfg.run.out),
        threads_per_worker(cfg.run.threads, cfg.launch.local_workers),
    )
    become_launcher(restarts=True)
    relabel(f"replica {job.replica} agent")
    with job_temp_folder() as temp:
        config = dataclasses.replace(
            launch_config(cfg.replace(nnodes=1), dataclasses.replace(plan, logs=temp / "agent")),
            nproc_per_node=1,
            max_restarts=cfg.launch.max_restarts or DEFAULT_RESTARTS,
        )
        try:
            elastic_launch(config, sys.executable)(*worker_args(flags, plan.out))
        except ChildFailedError as exc:
            message, status = describe_failure(exc.failures)
            print(f"trainscale train: error: replica {job.replica}: {message}", file=sys.stderr)
            return status
        except SignalException as exc:
            return 128 + int(exc.sigval)
    return 0


def run_worker(cfg: TrainConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A worker's entry: train, with any exception recorded to the agent's error file (torch's ``@record``,
    written atomically: see ``worker_errors``) so the parent can name the failed rank and its error."""
    return recorded(run_training)(cfg)
