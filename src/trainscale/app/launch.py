"""`trainscale train` in a distributed mode: check everything, start the workers with torch's elastic
agent, and report as one job.

The parent process (what the user ran) never trains. It runs the pre-flight (``app.preflight``) and finds the
rendezvous (``app.rendezvous``), so every mistake it can see is one line and exit 2 before any worker exists.
Then ``torch.distributed.launcher.api.elastic_launch`` runs the agent: a c10d rendezvous (node 0 hosts it; on
one node a free port on 127.0.0.1), ``--workers`` copies of ``trainscale train <the same flags>`` (``app.worker_env``)
with RANK/WORLD_SIZE/... set, restarts up to ``--max-restarts`` times, and on a failure
stops every worker and raises ``ChildFailedError``, which becomes one line naming the failed rank and its error
(``app.failures``; workers are wrapped in ``@record`` so their exception reaches the agent). On success node 0
prints the table and summary from the run folder (``app.outcome``).

How a worker starts (``start_method``): the command line's launcher has the agent fork its workers, which then
share the launcher's imports (``import torch`` alone costs seconds of CPU per process, several per worker where
cores are few, as on a 2-core machine) and run ``train`` from ``worker``, the entry point's function, after
``as_new_process`` puts back what the launcher changed in itself. Where a fork could inherit a CUDA runtime (a
CUDA build of torch, unless the run is on the CPU by ``--device cpu``) or the launcher is a caller's process
(``trainscale.fit`` in a notebook, with whatever it imported and started), each worker is a new interpreter,
``python -m trainscale train``, as torchrun starts them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousConnectionError, RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainscale.app.config import TrainConfig
from trainscale.app.exits import ChildExits, note_worker
from trainscale.app.failures import (
    describe_failure,
    every_failure,
    refuse_job,
    root_traceback,
    write_node_report,
    write_report,
)
from trainscale.app.ft_launch import DEFAULT_RESTARTS, Meeting, launch_replicas, record_ps_faults
from trainscale.app.outcome import report
from trainscale.app.preflight import preflight
from trainscale.app.rendezvous import bind_address, rendezvous_address, run_id
from trainscale.app.run import run_training
from trainscale.app.worker_env import fault_log_folder, logged_faults, train_argv, worker_args, worker_env
from trainscale.errors import TrainscaleError
from trainscale.log import relabel
from trainscale.record import SUMMARY, K
from trainscale.results import lock_run_folder, read_json
from trainscale.runtime import ft
from trainscale.runtime.cpus import oversubscription, threads_per_worker
from trainscale.runtime.job import REFUSAL_ENV, Job, this_job
from trainscale.runtime.network import LOCALHOST
from trainscale.runtime.orphans import become_launcher, die_with_parent
from trainscale.runtime.rendezvous import close_rendezvous, held_endpoint, register_backend
from trainscale.runtime.tempdir import compiler_cache, environ, launcher_temp_parent, short_enough
from trainscale.runtime.worker_errors import recorded
from trainscale.stops import stop_word
from trainscale.train.setup import claimed_out

log = logging.getLogger("trainscale.launch")

MONITOR_INTERVAL_S = 0.1

Worker = Callable[..., None]  # runs one forked worker from its `train` command line (``start_method``)


@dataclass(frozen=True)
class LaunchPlan:
    """What the checks resolved: where to meet, who hosts, the run folder, threads per worker."""

    endpoint: str
    is_host: bool
    run_id: str
    out: Path | None
    threads: int
    logs: Path | None = None  # the agent's folder for the workers' error files (``job_temp_folder``)
    refusal: Path | None = None  # where a worker's refusal ends the job without a restart (``refuse_job``)
    start_method: str = "spawn"  # "fork": the agent forks the workers from this process (``start_method``)


@contextlib.contextmanager
def job_temp_folder(parent: Path | None = None) -> Iterator[Path]:
    """A folder of this launcher's, removed with it, for what a job would otherwise leave in the temporary folder:
    torch's elastic agent keeps its workers' error files in a folder it never removes (here: ``agent/``), and a
    worker stopped by a signal ends without Python's clean-up (``runtime.orphans``), so its own temporary files
    (the ``pymp-*`` folders of DataLoader workers) stay; the processes it starts get this folder as their TMPDIR.
    It is made in /tmp where the usual temporary folder is too deep for the Unix sockets made in it
    (``runtime.tempdir``); only where no short folder can be had do the processes keep the usual TMPDIR.
    ``parent``: where to make it (a fault-tolerant replica's is in its launcher's, ``Job.temp_root``, so it goes
    with the launcher's even where the replica was killed). torch's compiler cache keeps its usual place, so
    compiled kernels are still reused across runs."""
    where = parent if parent is not None else launcher_temp_parent("ts")
    with tempfile.TemporaryDirectory(prefix="ts", dir=where) as folder:
        short = short_enough(folder)
        with environ({"TMPDIR": folder, "TORCHINDUCTOR_CACHE_DIR": compiler_cache()} if short else {}):
            yield Path(folder)


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


def launched_by_trainscale(job: Job) -> bool:
    """True in a worker whose parent is `trainscale train` (which prints the results itself)."""
    return job.by_trainscale


def start_method(cfg: TrainConfig, worker: Worker | None) -> str:
    """How the agent starts this node's workers: "fork" where the entry point gave a ``worker`` function,
    ``--start-method`` is auto and no CUDA runtime can be inherited (a CPU build of torch, or ``--device cpu``
    without ``--devices``: a CUDA runtime initialised before a fork cannot be used in the child, and the pre-flight
    asks CUDA about its devices); "spawn" otherwise (see the module docstring)."""
    import torch

    if worker is None or cfg.launch.devices or cfg.launch.start_method == "spawn":
        return "spawn"
    cuda_build = torch.version.cuda is not None or torch.version.hip is not None
    return "fork" if not cuda_build or cfg.run.device == "cpu" else "spawn"


def worker_entry(plan: LaunchPlan, flags: dict[str, Any], worker: Worker | None) -> tuple[Worker | str, list[str]]:
    """What the agent runs for each worker, and its arguments: ``worker`` with the `train` command line, forked, or
    a new interpreter (``sys.executable``) with ``-m trainscale train ...``. Forked workers find torch's compiler
    front end imported: every worker imports it (a model's first backward does), about as long as ``import torch``
    itself, so here it is imported once for all of them."""
    if plan.start_method == "fork" and worker is not None:
        importlib.import_module("torch._dynamo")
        return worker, train_argv(flags, plan.out)
    return sys.executable, worker_args(flags, plan.out)


def failures_of(exc: ChildFailedError, exits: ChildExits | None) -> dict[int, ProcessFailure]:
    """The failed workers torch's agent reports, with the other ranks that failed on their own where it reports
    only the first: forked workers, whose deaths ``exits`` watched (``app.exits``, ``app.failures.every_failure``)."""
    return every_failure(exc.failures, exits.of_worker) if exits is not None else exc.failures


def as_new_process() -> None:
    """In a worker forked from its launcher (``start_method``), before anything else: what the launcher changed in
    itself, undone, so the worker starts as a new interpreter would. The agent's signal handlers go (Ctrl-C is
    a KeyboardInterrupt again, until the worker asks to end quietly); the temporary folder is read again from
    TMPDIR (the launcher's job folder, ``job_temp_folder``; Python remembers the one it saw first); log lines
    name this rank, not the launcher; the user's modules are imported again (``forget_user_modules``); who it is
    is noted for the launcher, which reaps no workers itself (``app.exits``); torch's C++ log level is read
    again from TORCH_CPP_LOG_LEVEL (``cpp_log_level_from_env``)."""
    for sig in AGENT_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    tempfile.tempdir = None
    cpp_log_level_from_env()
    relabel(f"rank {os.environ.get('RANK', '0')}")
    forget_user_modules()
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        note_worker(os.environ["TORCHELASTIC_ERROR_FILE"])  # for the launcher's triage (``app.exits``)


CPP_LOG_LEVELS = {"INFO": 0, "WARNING": 1, "ERROR": 2, "FATAL": 3}  # c10's, as TORCH_CPP_LOG_LEVEL names them


def cpp_log_level_from_env() -> None:
    """torch's C++ log level as TORCH_CPP_LOG_LEVEL gives it (``worker_env`` sets ERROR for parameter-server jobs,
    whose RPC shutdown makes TensorPipe warn of every closed connection), else torch's own (WARNING). c10 reads the
    variable once, when torch loads, so a worker forked from a launcher kept the launcher's level (set later, or
    quieted: ``store_warnings_quiet``): its flag is set here. A no-op for an unknown level, or a torch build whose
    library lacks the flag."""
    level = os.environ.get("TORCH_CPP_LOG_LEVEL", "").strip().upper() or "WARNING"
    value = CPP_LOG_LEVELS.get(level, int(level) if level.isdigit() else None)
    if value is not None:
        cpp_log_level(value)


def cpp_log_level(value: int | None = None) -> int | None:
    """c10's log level (``CPP_LOG_LEVELS``) as it was, then set to ``value`` where given; None where the library
    has no such flag."""
    import torch

    try:
        c10 = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        flag = ctypes.c_int.in_dll(c10, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None
    was = int(flag.value)
    if value is not None:
        flag.value = value
    return was


@contextlib.contextmanager
def store_warnings_quiet(quiet: bool) -> Iterator[None]:
    """torch's C++ warnings off in this launcher while its agent runs, where ``quiet``: a node that does not host
    the rendezvous, whose agent's C++ code speaks only of the store's connection, about 30 lines with a stack each
    time node 0's launcher ends, above the one line this launcher says then (``run_agents``)."""
    before = cpp_log_level(CPP_LOG_LEVELS["ERROR"]) if quiet else None
    try:
        yield
    finally:
        if before is not None:
            cpp_log_level(before)


def forget_user_modules() -> None:
    """Drop the modules the launcher imported from outside Python's installation, its environment's packages and
    trainscale: the user's model, data or optimizer named by import path, and what they import from their own
    folders. A forked worker then imports them itself, as a new interpreter would, with its own environment
    (its rank, its devices) and with an error of its own where they do not import there."""
    homes = tuple(dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(__file__).parents[1]))))
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if where and name != "__main__" and not where.startswith(homes):
            del sys.modules[name]


@contextlib.contextmanager
def prepared(cfg: TrainConfig, worker: Worker | None = None) -> Iterator[LaunchPlan]:
    """The pre-flight (``app.preflight``: each failure one line, exit 2), then where this node meets the others
    (held for the launch: ``rendezvous_address``) and how its workers start."""
    checked = preflight(cfg)
    crowded = None if cfg.launch.devices else oversubscription(cfg.launch.local_workers + cfg.ps.servers)
    if crowded:
        log.warning("%s", crowded)  # once, by the launcher: the workers do not repeat it
    with rendezvous_address(cfg) as (endpoint, is_host):
        yield LaunchPlan(
            endpoint,
            is_host,
            run_id(cfg),
            checked.out,
            threads_per_worker(cfg.run.threads, cfg.launch.local_workers),
            start_method=start_method(cfg, worker),
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
        start_method=plan.start_method,
        local_addr=bind_address(plan.endpoint, plan.is_host),
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.logs)) if plan.logs is not None else None,
    )


def launch(cfg: TrainConfig, flags: dict[str, Any], job: Job | None = None, worker: Worker | None = None) -> int:
    """Run the job (``job``: this launcher's place in it, by default the entry's; ``worker``: the entry point's
    function that runs a forked worker's `train` command line, None where workers must be new interpreters: see
    the module docstring); returns the exit status (0, 1 for a failed worker, 2 for a user error in a worker)."""
    job = job or this_job()
    if job.replica is not None:
        return run_replica_agent(cfg, flags, job, worker)
    with (
        prepared(cfg, worker) as plan,
        claimed_out(cfg) if plan.out is not None else contextlib.nullcontext(None) as out,  # node 0 owns it
    ):
        if out is not None:
            cfg, plan = cfg.replace(out=str(out)), dataclasses.replace(plan, out=out)
        with fault_log_folder(cfg, plan.out) as fault_log, job_temp_folder() as temp, signal_handlers_kept():
            os.environ.update(worker_env(cfg, plan.threads, fault_log))
            restarted = cfg.launch.max_restarts > 0 and not cfg.replication.fault_tolerance
            plan = dataclasses.replace(plan, logs=temp / "agent", refusal=temp / "refusal" if restarted else None)
            with environ({REFUSAL_ENV: str(plan.refusal)} if plan.refusal is not None else {}):
                return run_agents(cfg, flags, plan, worker)


def run_agents(cfg: TrainConfig, flags: dict[str, Any], plan: LaunchPlan, worker: Worker | None = None) -> int:
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
        "starting %d worker(s)%s on node %d of %d (rendezvous %s, %d thread(s) each, %s)",
        cfg.launch.workers,
        servers,
        cfg.launch.node_rank,
        cfg.launch.nnodes,
        plan.endpoint,
        plan.threads,
        "forked from this process" if plan.start_method == "fork" else "each a new interpreter",
    )
    events = plan.out / ft.EVENTS_FILE if plan.out is not None and cfg.ps.servers else None
    exits = ChildExits() if plan.start_method == "fork" else None
    try:
        # the run folder locked for the whole job, restarts included: no second job writes there
        with lock_run_folder(plan.out), exits or contextlib.nullcontext():
            if events is not None and not cfg.run.resume and events.exists():
                events.unlink()
            entry, args = worker_entry(plan, flags, worker)
            with store_warnings_quiet(cfg.launch.nnodes > 1 and not plan.is_host):
                elastic_launch(launch_config(cfg, plan), entry)(*args)
    except ChildFailedError as exc:
        failures = failures_of(exc, exits)
        message, status = describe_failure(failures, cfg.launch.workers if cfg.ps.servers else None)
        write_node_report(failures, message, status, this_job().node_report)
        trace = root_traceback(failures)  # the workers leave it to this process (``worker_errors``)
        print(
            f"{trace}\ntrainscale train: error: {message}" if trace else f"trainscale train: error: {message}",
            file=sys.stderr,
        )
        return status
    except RendezvousError as exc:
        print(f"trainscale train: error: {rendezvous_failure(exc, plan)}", file=sys.stderr)
        return 1
    except SignalException as exc:  # Ctrl-C or a scheduler's SIGTERM: the agent has stopped the workers
        if plan.refusal is not None and plan.refusal.exists():  # or a worker's refusal did (``refuse_job``)
            if cfg.launch.nnodes > 1 and not plan.is_host:
                close_rendezvous(plan.endpoint, plan.run_id, cfg.launch.nnodes)
            return refused(plan.refusal)
        print(f"trainscale train: {stop_word(exc.sigval)}; workers stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    if events is not None and plan.out is not None and (plan.out / SUMMARY).exists():
        record_ps_faults(plan.out, logged_faults(cfg))
        done = read_json(plan.out / SUMMARY).get(K.epochs_completed, 0)
        if done < cfg.optim.epoch_count:  # every worker died, each one survivable on its own
            print(
                f"trainscale train: error: every worker died; the run folder holds {done} of {cfg.optim.epoch_count} "
                "epoch(s); --resume continues from the last one",
                file=sys.stderr,
            )
            return 1
    report(cfg, plan.out)
    return 0


def rendezvous_failure(exc: RendezvousError, plan: LaunchPlan) -> str:
    """What ended this node's part in the rendezvous, in one line: another node that closed it (its workers failed
    for good, or refused), node 0's store gone (its launcher ended, or the network between), or torch's words."""
    if isinstance(exc, RendezvousClosedError):
        return f"another node ended the job (it closed the rendezvous at {plan.endpoint}); its own output says why"
    if isinstance(exc, RendezvousConnectionError) and not plan.is_host:
        return (
            f"lost the rendezvous at {plan.endpoint}: node 0's launcher ended or cannot be reached; its own output "
            "says why"
        )
    return f"rendezvous at {plan.endpoint} failed: {type(exc).__name__}: {exc}"


def refused(refusal: Path) -> int:
    """End the job with a worker's refusal (``refuse_job``), whose SIGTERM had the agent stop the workers: its
    line, and status 2 as for any bad input, with no restart."""
    line = refusal.read_text().strip()
    write_report(this_job().node_report, line, 2, False, time.time_ns())
    print(f"trainscale train: error: {line}", file=sys.stderr)
    return 2


def run_replica_agent(cfg: TrainConfig, flags: dict[str, Any], job: Job, worker: Worker | None = None) -> int:
    """One replica of a fault-tolerant job (``ft_launch``): torch's elastic agent with one worker, restarted
    alone when it dies (``--max-restarts`` times; 0 means ``DEFAULT_RESTARTS``), dying with the launcher."""
    die_with_parent(signal.SIGKILL, job.owner_pid)
    address = job.address or LOCALHOST
    assert cfg.run.out is not None  # a fault-tolerant job's --out is resolved before its replicas start
    become_launcher(restarts=True)
    relabel(f"replica {job.replica} agent")
    with held_endpoint(address) as endpoint, job_temp_folder(job.temp_root) as temp:
        plan = LaunchPlan(
            endpoint,
            True,
            uuid.uuid4().hex,
            Path(cfg.run.out),
            threads_per_worker(cfg.run.threads, cfg.launch.local_workers),
            start_method=start_method(cfg, worker),
        )
        config = dataclasses.replace(
            launch_config(cfg.replace(nnodes=1), dataclasses.replace(plan, logs=temp / "agent")),
            nproc_per_node=1,
            max_restarts=cfg.launch.max_restarts or DEFAULT_RESTARTS,
        )
        try:
            entry, args = worker_entry(plan, flags, worker)
            elastic_launch(config, entry)(*args)
        except ChildFailedError as exc:
            message, status = describe_failure(exc.failures)  # its one worker
            print(f"trainscale train: error: replica {job.replica}: {message}", file=sys.stderr)
            return status
        except SignalException as exc:
            return 128 + int(exc.sigval)
    return 0


def run_worker(cfg: TrainConfig, job: Job) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A worker's entry: train, with any exception recorded to the agent's error file (torch's ``@record``,
    written atomically: see ``worker_errors``) so the parent can name the failed rank and its error; a
    refusal where a restart would meet it again also goes to the job's launcher (``refuse_job``)."""
    try:
        return recorded(run_training)(cfg)
    except TrainscaleError as refusal:
        refuse_job(job, refusal, cfg.launch.workers if cfg.ps.servers else None)
        raise
