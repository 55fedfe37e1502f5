"""The launcher of a fault-tolerant job (`trainscale train --fault-tolerance`): it hosts torchft's lighthouse and
the start barrier (on 127.0.0.1; across machines node 0's launcher, at the rendezvous endpoint: ``Meeting``) and
starts one replica per worker: each is `trainscale train` with the same flags run as a replica agent (its job
description says so: ``Job.replica``), i.e. torch's elastic agent with one worker and its own restarts, so a dead
replica is restarted alone and the survivors never are. A watchdog kills a replica's worker that has been stopped
(SIGSTOP, a hung host) for longer than ``--ft-timeout`` plus the heartbeat timeout: by then the others have
dropped it, and its agent restarts it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.log import relabel
from trainscale.results import lock_run_folder
from trainscale.runtime import ft
from trainscale.runtime.faults import job_processes
from trainscale.runtime.job import (
    ADDRESS_ENV,
    BARRIER_ENV,
    EVENTS_ENV,
    NODE_ENV,
    OWNER_ENV,
    REFUSAL_ENV,
    REPLICA_ENV,
    REPLICAS_ENV,
    TEMP_ENV,
)
from trainscale.runtime.network import check_port_free, interface_of, parse_endpoint
from trainscale.runtime.orphans import become_launcher, process_state, sigterm_as_interrupt
from trainscale.runtime.tempdir import launcher_temp_parent
from trainscale.stops import stops_held

log = logging.getLogger("trainscale.launch")

DEFAULT_RESTARTS = 5
WATCH_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 1.0
FINALS_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Meeting:
    """Where a fault-tolerant job's replicas meet. On one machine: the lighthouse and the start barrier on free
    ports of 127.0.0.1. On several (``--nnodes``, ``--cluster``): node 0 hosts the lighthouse at the rendezvous
    endpoint and the barrier on the next port; every node's replicas listen on ``address``, the node's own
    address toward node 0 (gloo too: ``GLOO_SOCKET_IFNAME`` is its interface)."""

    endpoint: str
    is_host: bool
    address: str
    nodes: int

    def ports(self) -> tuple[str, int, int]:
        """(host, lighthouse port, barrier port); 0: any free one (one machine)."""
        host, port = parse_endpoint(self.endpoint)
        return (host, port, port + 1) if self.nodes > 1 else (host, 0, 0)


@contextlib.contextmanager
def meeting_points(meeting: Meeting) -> Iterator[tuple[str, str]]:
    """(lighthouse URL, barrier host:port): served here on node 0, node 0's elsewhere (reachable by now: the
    launch checks waited for the endpoint)."""
    host, lighthouse_port, barrier_port = meeting.ports()
    if not meeting.is_host:
        yield f"http://{host}:{lighthouse_port}", f"{host}:{barrier_port}"
        return
    if barrier_port:
        check_port_free(host, barrier_port)
    with (
        ft.barrier_store(host, barrier_port) as barrier,
        ft.lighthouse(host, HEARTBEAT_TIMEOUT_S, lighthouse_port) as lighthouse,
    ):
        yield lighthouse, barrier


def replica_env(
    cfg: Any, index: int, points: tuple[str, str], meeting: Meeting, events: Path, temp: Path
) -> dict[str, str]:
    """The environment of replica ``index``'s agent: this launcher's, and who the replica is (``runtime.job``);
    ``temp``: this launcher's temporary folder, which holds the replicas' own (removed with it, also where a
    replica was killed, and where it could not become their TMPDIR) and the refusal file (``refusal_file``)."""
    env = {
        **os.environ,
        REFUSAL_ENV: str(refusal_file(temp)),
        TEMP_ENV: str(temp),
        REPLICA_ENV: str(index),
        REPLICAS_ENV: str(job_processes(cfg.launch)),
        ft.LIGHTHOUSE_ENV: points[0],
        BARRIER_ENV: points[1],
        EVENTS_ENV: str(events),
        OWNER_ENV: str(os.getpid()),
        ADDRESS_ENV: meeting.address,
        NODE_ENV: str(cfg.launch.node_rank),
        "RUST_LOG": os.environ.get("RUST_LOG", "warn"),
    }
    env.setdefault("GLOO_SOCKET_IFNAME", interface_of(meeting.address))
    return env


def refusal_file(temp: Path) -> Path:
    """Where a replica's worker hands its refusal to this launcher (``app.failures.refuse_job``)."""
    return temp / "refusal"


def run_replicas(cfg: Any, argv: list[str], out: Path | None, meeting: Meeting) -> int:
    """Run this node's replicas to the end, holding the run folder's lock; returns the job's exit status (the
    first failed replica's). ``out``: the run folder on node 0 (which records the faults), None on the others."""
    become_launcher()
    relabel(f"node {cfg.launch.node_rank} launcher" if cfg.launch.nnodes > 1 else "launcher")
    events = Path(out or cfg.run.out) / ft.EVENTS_FILE
    workers = cfg.launch.workers or 1
    first = cfg.launch.node_rank * workers
    with (
        sigterm_as_interrupt(),
        lock_run_folder(out),
        tempfile.TemporaryDirectory(prefix="ts-ft-", dir=launcher_temp_parent("ts-ft-")) as made,
    ):
        if out is not None and not cfg.run.resume and events.exists():
            events.unlink()
        temp = Path(made)
        with meeting_points(meeting) as points:
            log.info("starting %d fault-tolerant replica(s) (lighthouse %s)", workers, points[0])
            procs: list[subprocess.Popen] = []
            try:
                with stops_held():  # a stop while the replicas start comes once all are in ``procs``
                    procs.extend(
                        subprocess.Popen(
                            [sys.executable, *argv],
                            env=replica_env(cfg, i, points, meeting, events, temp),
                            start_new_session=True,
                        )
                        for i in range(first, first + workers)
                    )
                status = watch(procs, cfg.replication.ft_timeout + HEARTBEAT_TIMEOUT_S, refusal_file(temp))
                if status == 0 and out is not None and cfg.launch.nnodes > 1:
                    replicas = job_processes(cfg.launch)
                    assert replicas is not None  # known once there are several nodes
                    wait_for_finals(events, replicas)
            finally:
                kill_all(procs)
    return status


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL to every replica still running, all of them before any is waited for: killed and reaped one by one,
    a replica lived on to log the end of the one before it as a failure ("step N not committed") below the
    launcher's line for a Ctrl-C."""
    alive = [proc for proc in procs if proc.poll() is None]
    for proc in alive:
        os.killpg(proc.pid, signal.SIGKILL)
    for proc in alive:
        proc.wait()


def wait_for_finals(events: Path, replicas: int, timeout_s: float = FINALS_TIMEOUT_S) -> None:
    """Keep the lighthouse up until every replica has logged its end (the other nodes' replicas finish the last
    step with node 0's, give or take an evaluation; one that was cut off comes back, finds the job over and
    leaves), so none is left without it and the record is whole."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len({e["replica"] for e in ft.read_events(events) if e["event"] in ("final", "left")}) >= replicas:
            return
        time.sleep(WATCH_INTERVAL_S)
    log.warning("not every replica logged its end within %.0f s of node 0's", timeout_s)


def watch(procs: list[subprocess.Popen], stopped_limit_s: float, refusal: Path) -> int:
    """Wait for every replica agent; kill workers stopped for longer than ``stopped_limit_s``. A failed
    agent (out of restarts, or a user error) ends the job with its status, a worker's refusal
    (``app.failures.refuse_job``) with its one line and status 2."""
    stopped_since: dict[int, float] = {}
    while True:
        if refusal.exists():
            print(f"trainscale train: error: {refusal.read_text().strip()}", file=sys.stderr)
            return 2
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        now = time.monotonic()
        for pid in stopped_workers(procs):
            since = stopped_since.setdefault(pid, now)
            if now - since > stopped_limit_s:
                log.warning(
                    "replica worker %d has been stopped for %.1f s: killing it (its agent restarts it)",
                    pid,
                    now - since,
                )
                os.kill(pid, signal.SIGKILL)
                stopped_since.pop(pid)
        time.sleep(WATCH_INTERVAL_S)


def stopped_workers(procs: list[subprocess.Popen]) -> list[int]:
    """Pids of the agents' children in the stopped state (``T`` in /proc/PID/stat)."""
    agents = {p.pid for p in procs}
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [pid for pid in pids if (state := process_state(pid)) is not None and state[0] == "T" and state[1] in agents]
