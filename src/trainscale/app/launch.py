"""`trainscale train` in a distributed mode: check everything, start the workers with torch's elastic
agent, and report as one job.

The parent process (what the user ran) never trains. It validates the config, the data, the shard
sizes, the run folder and the rendezvous address, so every mistake it can see is one line and exit 2
before any worker exists. Then ``torch.distributed.launcher.api.elastic_launch`` runs the agent: a
c10d rendezvous (node 0 hosts it; on one node a free port on 127.0.0.1), ``--workers`` copies of
``python -m trainscale train <the same flags>`` with RANK/WORLD_SIZE/... set, restarts up to
``--max-restarts`` times, and on a failure stops every worker and raises ``ChildFailedError``, which
becomes one line naming the failed rank and its error (workers are wrapped in ``@record`` so their
exception reaches the agent). On success node 0 prints the table and summary from the run folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainscale.app.config import TrainConfig
from trainscale.app.ft_launch import DEFAULT_RESTARTS, Meeting, launch_replicas, record_ps_faults
from trainscale.app.run import load_baseline, run_training
from trainscale.console import EPOCH_COLUMNS, format_summary, format_table
from trainscale.errors import ConfigError
from trainscale.io import atomic_write_text, dumps
from trainscale.log import relabel
from trainscale.modes import mode_class
from trainscale.modes.ps.stats import summary_line as ps_summary_line
from trainscale.results import lock_run_folder, read_history, read_json
from trainscale.runtime.cpus import threads_per_worker
from trainscale.runtime.faults import InjectedFault, injected_faults, on_cluster
from trainscale.runtime.network import (
    LOCALHOST,
    check_port_free,
    free_port,
    local_address_toward,
    parse_endpoint,
    wait_reachable,
)
from trainscale.runtime import ft
from trainscale.runtime.job import NODE_REPORT_ENV, Job, this_job  # noqa: F401  (NODE_REPORT_ENV: cluster_run writes it)
from trainscale.runtime.orphans import become_launcher, die_with_parent
from trainscale.runtime.rendezvous import register_backend
from trainscale.runtime.worker_errors import recorded
from trainscale.train.precision import Precision, resolve_device
from trainscale.train.setup import check_fits, check_model_input, check_run_folder, load_data, resolve_out

log = logging.getLogger("trainscale.launch")

DEFAULT_MULTINODE_ID = "trainscale"
MONITOR_INTERVAL_S = 0.1
CONSEQUENCES = ("peer", "stopped")  # failure kinds caused by another process's failure (see worker_errors)


@dataclass(frozen=True)
class LaunchPlan:
    """What the checks resolved: where to meet, who hosts, the run folder, threads per worker."""

    endpoint: str
    is_host: bool
    run_id: str
    out: Path | None
    threads: int


def launched_by_trainscale(job: Job) -> bool:
    """True in a worker whose parent is `trainscale train` (which prints the results itself)."""
    return job.by_trainscale


# ------------------------------------------------------------------------------------ the checks


def check_devices(cfg: TrainConfig) -> None:
    """GPUs, precision, backend and the mode's device needs against what this machine has."""
    if cfg.devices:
        if not torch.cuda.is_available():
            raise ConfigError("--devices/--gpus needs CUDA GPUs and this machine has none; use --workers N on the CPU")
        if max(cfg.devices) >= torch.cuda.device_count() or cfg.device == "cpu":
            raise ConfigError(f"--devices {','.join(map(str, cfg.devices))}: this machine has "
                              f"{torch.cuda.device_count()} GPU(s) and --device is {cfg.device}")
    device = torch.device("cuda") if cfg.devices else resolve_device(cfg.device)
    Precision(cfg.precision, device)
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError("--backend nccl needs CUDA devices; use gloo (the default) on the CPU")
    mode_class(cfg.mode).check_device(cfg, device)


def check_data(cfg: TrainConfig) -> None:
    """Load the data once here (download/verify included) and check every rank gets a usable shard."""
    train, test = load_data(cfg)
    check_fits(cfg, len(train), len(test), cfg.workers * cfg.nnodes)


def rendezvous_address(cfg: TrainConfig) -> tuple[str, bool]:
    """(endpoint, is_host): node 0 hosts the c10d store, others must be able to reach it."""
    if cfg.rdzv_endpoint is None:
        return f"{LOCALHOST}:{free_port(LOCALHOST)}", True
    host, port = parse_endpoint(cfg.rdzv_endpoint)
    if cfg.node_rank == 0:
        check_port_free(host, port)
        return cfg.rdzv_endpoint, True
    wait_reachable(host, port, cfg.rdzv_timeout)
    return cfg.rdzv_endpoint, False


def prepare(cfg: TrainConfig) -> LaunchPlan:
    """Every check that can run before the workers; each failure is a ConfigError (one line, exit 2)."""
    check_devices(cfg)
    check_model_input(cfg)
    out = resolve_out(cfg) if cfg.node_rank == 0 else None
    if out is not None:  # node 0's first worker owns the run folder (and reads --baseline)
        load_baseline(cfg)
        check_run_folder(out, cfg.resume, cfg)  # a probe file too: an unwritable --out starts no worker
    check_data(cfg)
    endpoint, is_host = rendezvous_address(cfg)
    run_id = cfg.rdzv_id or (DEFAULT_MULTINODE_ID if cfg.nnodes > 1 else uuid.uuid4().hex)
    return LaunchPlan(endpoint, is_host, run_id, out, threads_per_worker(cfg.threads, cfg.workers))


# ------------------------------------------------------------------------------------ launching


def to_argv(flags: dict[str, Any]) -> list[str]:
    """Parsed `train` flags back to command-line form (switches as --x/--no-x, lists comma-joined)."""
    argv: list[str] = []
    for key, value in flags.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif isinstance(value, (list, tuple)):
            argv += [name, ",".join(map(str, value))]
        else:
            argv += [name, str(value)]
    return argv


def worker_args(flags: dict[str, Any], plan: LaunchPlan) -> list[str]:
    """Arguments after ``sys.executable``: the same `train` flags, with the resolved run folder."""
    overrides = {"out": str(plan.out)} if plan.out is not None else {}
    return ["-u", "-m", "trainscale", "train", *to_argv({**flags, **overrides})]


def worker_env(cfg: TrainConfig, plan: LaunchPlan, fault_log: Path | None) -> dict[str, str]:
    """Variables for the agent (this process) and the workers it starts (they inherit its environment).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default torch's agent hands its rendezvous store to the
    workers and keeps it across restarts; restarted workers then find the dead ones' keys (gloo
    addresses, init counters) and fail with "Connection refused" or hang in init_process_group (seen
    here in 2 of 5 restarts). Unshared, each rendezvous round gets a fresh store on a fresh port,
    the same on every node. (``process_group.attempt_store`` covers an external torchrun on one node.)

    TORCH_CPP_LOG_LEVEL=ERROR in parameter-server jobs (unless already set): RPC shuts down locally
    (see ``process_group.rpc_session``), and TensorPipe logs a C++ warning on every peer for every
    connection that closes, a screenful at each normal exit. The PS reports dead peers itself.
    """
    env = {"OMP_NUM_THREADS": str(plan.threads), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if mode_class(cfg.mode).uses_servers and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    if fault_log is not None:  # a parameter-server job's faults, deaths and hand-overs
        env[ft.EVENTS_ENV] = str(fault_log / ft.EVENTS_FILE)
    if cfg.devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.devices))
    return env


@contextlib.contextmanager
def fault_log_folder(cfg: TrainConfig, plan: LaunchPlan) -> Iterator[Path | None]:
    """Where this node's parameter-server processes log faults, deaths and hand-overs (None in other modes): node
    0's run folder; on an emulated cluster, whose hosts share one file system, every node's (the same ``--out``).
    On the other nodes of a job across real machines, a folder of this launcher's, removed with it: the run's
    summary does not see their faults (another node's folder of that name is not the run's), but a restarted
    attempt there still knows which of its injected faults fired already (``runtime.faults.not_yet_fired``)."""
    if not mode_class(cfg.mode).uses_servers:
        yield None
    elif plan.out is not None or (cfg.out and on_cluster(this_job())):
        yield plan.out or Path(cfg.out)
    else:
        with tempfile.TemporaryDirectory(prefix="trainscale-faults-") as folder:
            yield Path(folder)


def logged_faults(cfg: TrainConfig) -> list[InjectedFault]:
    """The injected faults whose firing node 0's fault log is sure to record (for its "never fired" warning):
    all of them where the nodes share it (one machine, an emulated cluster); none across real machines, where
    the rendezvous decides which machine runs which worker and shard (``fault_log_folder``)."""
    return injected_faults(cfg) if cfg.nnodes == 1 or on_cluster(this_job()) else []


def bind_address(plan: LaunchPlan) -> str:
    """The address this node's listeners use: the rendezvous host on the node hosting it (127.0.0.1 on one
    machine), this machine's address toward it on the others. Node 0's workers meet at this address."""
    host, _ = parse_endpoint(plan.endpoint)
    return host if plan.is_host else local_address_toward(host)


def launch_config(cfg: TrainConfig, plan: LaunchPlan) -> LaunchConfig:
    """torch's LaunchConfig: fixed node count, torch's c10d rendezvous with its store bound to one address
    (``runtime.rendezvous``), a 0.1 s monitor so failures stop the job fast."""
    return LaunchConfig(min_nodes=cfg.nnodes, max_nodes=cfg.nnodes, nproc_per_node=cfg.workers + cfg.servers,
                        run_id=plan.run_id, rdzv_backend=register_backend(), rdzv_endpoint=plan.endpoint,
                        rdzv_configs={"is_host": plan.is_host, "join_timeout": int(cfg.rdzv_timeout)},
                        max_restarts=cfg.max_restarts, monitor_interval=MONITOR_INTERVAL_S, start_method="spawn",
                        local_addr=bind_address(plan))


def launch(cfg: TrainConfig, flags: dict[str, Any], job: Job | None = None) -> int:
    """Run the job (``job``: this launcher's place in it, by default the entry's); returns the exit status (0, 1
    for a failed worker, 2 for a user error in a worker)."""
    job = job or this_job()
    if job.replica is not None:
        return run_replica_agent(cfg, flags, job)
    plan = prepare(cfg)
    with fault_log_folder(cfg, plan) as fault_log:
        os.environ.update(worker_env(cfg, plan, fault_log))
        return run_agents(cfg, flags, plan)


def run_agents(cfg: TrainConfig, flags: dict[str, Any], plan: LaunchPlan) -> int:
    """This node's part of the job under torch's elastic agent (or the fault-tolerant replicas' launchers)."""
    if cfg.fault_tolerance:
        meeting = Meeting(plan.endpoint, plan.is_host, bind_address(plan), cfg.nnodes)
        status = launch_replicas(cfg, worker_args(flags, plan), plan.out, meeting)
        if status == 0:
            report(cfg, plan)
        return status
    become_launcher()  # the workers die with this process, quietly (runtime.orphans)
    relabel(f"node {cfg.node_rank} launcher")
    servers = f" and {cfg.servers} parameter server(s)" if cfg.servers else ""
    log.info("starting %d worker(s)%s on node %d of %d (rendezvous %s, %d thread(s) each)", cfg.workers, servers,
             cfg.node_rank, cfg.nnodes, plan.endpoint, plan.threads)
    events = plan.out / ft.EVENTS_FILE if plan.out is not None and cfg.servers else None
    try:
        with lock_run_folder(plan.out):  # for the whole job, restarts included: no second job writes there
            if events is not None and not cfg.resume and events.exists():
                events.unlink()
            elastic_launch(launch_config(cfg, plan), sys.executable)(*worker_args(flags, plan))
    except ChildFailedError as exc:
        message, status = describe_failure(exc.failures, cfg.workers if cfg.servers else None)
        write_node_report(exc.failures, message, status, this_job().node_report)
        print(f"trainscale train: error: {message}", file=sys.stderr)
        return status
    except RendezvousError as exc:
        print(f"trainscale train: error: rendezvous at {plan.endpoint} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    except SignalException as exc:  # Ctrl-C or a scheduler's SIGTERM: the agent has stopped the workers
        print(f"trainscale train: interrupted by {exc.sigval.name}; workers stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    if events is not None and (plan.out / "summary.json").exists():
        record_ps_faults(plan.out, logged_faults(cfg))
        done = read_json(plan.out / "summary.json").get("epochs_completed", 0)
        if done < cfg.epochs:  # every worker died, each one survivable on its own
            print(f"trainscale train: error: every worker died; the run folder holds {done} of {cfg.epochs} "
                  "epoch(s); --resume continues from the last one", file=sys.stderr)
            return 1
    report(cfg, plan)
    return 0


def run_replica_agent(cfg: TrainConfig, flags: dict[str, Any], job: Job) -> int:
    """One replica of a fault-tolerant job (``ft_launch``): torch's elastic agent with one worker, restarted
    alone when it dies (``--max-restarts`` times; 0 means ``DEFAULT_RESTARTS``), dying with the launcher."""
    die_with_parent(signal.SIGKILL, job.owner_pid)
    address = job.address or LOCALHOST
    plan = LaunchPlan(f"{address}:{free_port(address)}", True, uuid.uuid4().hex, Path(cfg.out),
                      threads_per_worker(cfg.threads, cfg.workers))
    become_launcher()
    relabel(f"replica {job.replica} agent")
    config = dataclasses.replace(launch_config(dataclasses.replace(cfg, nnodes=1), plan), nproc_per_node=1,
                                 max_restarts=cfg.max_restarts or DEFAULT_RESTARTS)
    try:
        elastic_launch(config, sys.executable)(*worker_args(flags, plan))
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


# ------------------------------------------------------------------------------------ results


def recorded_field(failure: ProcessFailure, key: str) -> Any:
    """A field of the worker's error file (``kind``, ``time_ns``: see ``worker_errors``), None without one."""
    message = failure.message
    return message.get(key) if isinstance(message, dict) else None


def recorded_kind(failure: ProcessFailure) -> str | None:
    """The failure kind the worker recorded (``worker_errors.kind_of``), None when it recorded none."""
    return recorded_field(failure, "kind")


def recorded_message(failure: ProcessFailure) -> str:
    """The exception a worker recorded through ``@record`` ("" when it died without one)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message") or ""
    return "" if message.startswith("To enable traceback") else message.strip()


def failure_text(failure: ProcessFailure) -> str:
    """One line for a failed worker: its exception, the signal that killed it, or its exit code."""
    message = recorded_message(failure)
    if message:
        first = message.splitlines()[0]
        return first if len(first) <= 400 else first[:400] + "..."
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    return f"exited with status {failure.exitcode} (no exception recorded; see its output above)"


def is_consequence(failure: ProcessFailure) -> bool:
    """A worker the agent stopped (SIGTERM, or a recorded ``stopped``) or one that recorded losing a peer
    (closed connection, collective timeout, dead server): an effect of the root cause, not the cause."""
    if failure.exitcode == -signal.SIGTERM and recorded_kind(failure) is None:
        return True
    return recorded_kind(failure) in CONSEQUENCES


def failure_time_ns(failure: ProcessFailure) -> int:
    """When the failure was recorded: the worker's own nanosecond stamp (a root cause records before its
    peers notice it), else the agent's whole-second timestamp (a process killed without a word)."""
    stamp = recorded_field(failure, "time_ns")
    return int(stamp) if stamp is not None else int(failure.timestamp) * 10**9


def root_cause(failures: dict[int, ProcessFailure]) -> int:
    """The rank whose failure caused the others: the earliest that is not a consequence of another."""
    return min(failures, key=lambda r: (is_consequence(failures[r]), failure_time_ns(failures[r]), r))


def write_node_report(failures: dict[int, ProcessFailure], message: str, status: int, path: Path | None) -> None:
    """For a parent that runs several nodes (``train --cluster``) and must name the root cause among
    them: this node's failure line, whether it is a consequence, and when it was recorded, at ``path``
    (``Job.node_report``; None: no such parent)."""
    if path:
        failure = failures[root_cause(failures)]
        atomic_write_text(Path(path), dumps({"message": message, "status": status,
                                             "consequence": is_consequence(failure),
                                             "time_ns": failure_time_ns(failure)}))


def describe_failure(failures: dict[int, ProcessFailure], first_server: int | None = None) -> tuple[str, int]:
    """(one line naming the root-cause rank and its error, exit status): the earliest failure that is
    not a consequence of another; the agent then stopped the rest. ``first_server``: in parameter-server
    modes, local ranks from this one on are servers, and are named so."""
    rank = root_cause(failures)
    failure = failures[rank]
    kind = "parameter server" if first_server is not None and failure.local_rank >= first_server else "worker"
    line = f"{kind} rank {rank} (local rank {failure.local_rank}) failed: {failure_text(failure)}"
    others = sorted(r for r in failures if r != rank)
    if others:
        line += f"; the other workers were stopped (rank {', '.join(map(str, others))})"
    return line, 2 if failure.exitcode == 2 or recorded_kind(failure) == "user" else 1


def report(cfg: TrainConfig, plan: LaunchPlan) -> None:
    """Print what the run folder says, as `trainscale train` does for a local run."""
    if plan.out is None:
        print(f"node {cfg.node_rank}: all workers finished; the run folder is on node 0")
        return
    summary = read_json(plan.out / "summary.json")
    history = read_history(plan.out)
    print(format_table(history, EPOCH_COLUMNS))
    print(format_summary(summary))
    print(comm_line(summary))
    print(f"results in {plan.out}")


def comm_line(summary: dict[str, Any]) -> str:
    if summary.get("servers"):  # parameter-server modes
        return ps_summary_line(summary)
    sent = summary.get("bytes_sent_per_step")
    calls = summary.get("allreduce_calls_per_step")
    text = f"{summary.get('mode')} over {summary.get('backend')}, world size {summary.get('world_size')}"
    if summary.get("sync_every"):
        text += f", averaging every {summary['sync_every']} steps (outer lr {summary.get('outer_lr'):g})"
    if sent is not None:
        text += f": {sent / 2**20:.2f} MiB handed to collectives per worker per step in {calls:.3g} call(s)"
    if summary.get("scaling_efficiency") is not None:
        text += f"; scaling efficiency {100 * summary['scaling_efficiency']:.1f}% vs --baseline"
    return text
