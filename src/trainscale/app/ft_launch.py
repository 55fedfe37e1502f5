"""`trainscale train --fault-tolerance`: the launcher of a fault-tolerant job, and its fault record.

The launcher checks everything as for any distributed job, then hosts torchft's lighthouse and the
start barrier (on 127.0.0.1; across machines node 0's launcher, at the rendezvous endpoint: ``Meeting``) and
starts one replica per worker: each is `trainscale train` with the same flags run as a replica agent
(``TRAINSCALE_FT_REPLICA``), i.e. torch's elastic agent with one worker and its own restarts, so a dead replica
is restarted alone and the survivors never are. A watchdog
kills a replica's worker that has been stopped (SIGSTOP, a hung host) for longer than ``--ft-timeout``
plus the heartbeat timeout: by then the others have dropped it, and its agent restarts it.

At the end the launcher turns the replicas' event log into ``summary.json``'s ``faults`` (one object per
injected fault: detection and recovery seconds, steps lost) and ``replicas_equal`` (whether every
replica ended with bitwise-equal parameters and buffers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from trainscale.app.config import TrainConfig
from trainscale.log import relabel
from trainscale.record import SUMMARY, K
from trainscale.results import RunWriter, lock_run_folder, remove_debris
from trainscale.runtime import ft
from trainscale.runtime.faults import NODE_ENV, InjectedFault, injected_faults, job_processes
from trainscale.runtime.network import check_port_free, interface_of, parse_endpoint
from trainscale.runtime.orphans import become_launcher, process_state

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
    with ft.barrier_store(host, barrier_port) as barrier, \
            ft.lighthouse(host, HEARTBEAT_TIMEOUT_S, lighthouse_port) as lighthouse:
        yield lighthouse, barrier


def replica_env(cfg: TrainConfig, index: int, points: tuple[str, str], meeting: Meeting,
                events: Path) -> dict[str, str]:
    env = {**os.environ, ft.REPLICA_ENV: str(index), ft.REPLICAS_ENV: str(job_processes(cfg)),
           ft.LIGHTHOUSE_ENV: points[0], ft.BARRIER_ENV: points[1], ft.EVENTS_ENV: str(events),
           ft.OWNER_ENV: str(os.getpid()), ft.ADDRESS_ENV: meeting.address, NODE_ENV: str(cfg.node_rank),
           "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    env.setdefault("GLOO_SOCKET_IFNAME", interface_of(meeting.address))
    return env


def launch_replicas(cfg: TrainConfig, argv: list[str], out: Path | None, meeting: Meeting) -> int:
    """Run this node's replicas to the end; returns the job's exit status (the first failed replica's).
    ``out``: the run folder on node 0 (which records the faults), None on the others."""
    become_launcher()
    relabel(f"node {cfg.node_rank} launcher" if cfg.nnodes > 1 else "launcher")
    events = Path(out or cfg.out) / ft.EVENTS_FILE
    workers = cfg.workers or 1
    first = cfg.node_rank * workers
    with lock_run_folder(out):
        if out is not None and not cfg.resume and events.exists():
            events.unlink()
        with meeting_points(meeting) as points:
            log.info("starting %d fault-tolerant replica(s) (lighthouse %s)", workers, points[0])
            procs = [subprocess.Popen([sys.executable, *argv], env=replica_env(cfg, i, points, meeting, events),
                                      start_new_session=True) for i in range(first, first + workers)]
            try:
                status = watch(procs, cfg.ft_timeout + HEARTBEAT_TIMEOUT_S)
                if status == 0 and out is not None and cfg.nnodes > 1:
                    wait_for_finals(events, job_processes(cfg))
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
    if out is None:
        return status
    remove_debris(out)  # of a replica killed while writing
    if status == 0 and (out / SUMMARY).exists():
        record_faults(out, events, injected_faults(cfg))
    return status


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


def watch(procs: list[subprocess.Popen], stopped_limit_s: float) -> int:
    """Wait for every replica agent; kill workers stopped for longer than ``stopped_limit_s``. A failed
    agent (out of restarts, or a user error) ends the job with its status."""
    stopped_since: dict[int, float] = {}
    while True:
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
                log.warning("replica worker %d has been stopped for %.1f s: killing it (its agent restarts it)",
                            pid, now - since)
                os.kill(pid, signal.SIGKILL)
                stopped_since.pop(pid)
        time.sleep(WATCH_INTERVAL_S)


def stopped_workers(procs: list[subprocess.Popen]) -> list[int]:
    """Pids of the agents' children in the stopped state (``T`` in /proc/PID/stat)."""
    agents = {p.pid for p in procs}
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [pid for pid in pids if (state := process_state(pid)) is not None and state[0] == "T"
            and state[1] in agents]


def record_faults(out: Path, events_path: Path, injected: list[InjectedFault]) -> None:
    """Add ``faults``, ``replicas_equal`` and ``replicas_finished`` to summary.json, through its writer."""
    events = ft.read_events(events_path)
    faults = fault_records(events)
    fired = {(f["kind"], f["rank"], f["step"]) for f in faults}
    for fault in injected:
        if (fault.kind, fault.rank, fault.step) not in fired:
            log.warning("--inject-fault %s:%d@%d never fired: the job ended at step %s", fault.kind, fault.rank,
                        fault.step, max((e["step"] for e in events if e["event"] == "final"), default="?"))
    digests = {e["replica"]: e["digest"] for e in events if e["event"] == "final"}
    RunWriter(out, clean=False).merge_summary({K.faults: faults, K.replicas_equal: len(set(digests.values())) == 1
                                               if digests else None, K.replicas_finished: len(digests)})


def fault_records(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per injected fault that fired: detection (the fault to the first survivor that saw it: a
    step not committed or a smaller quorum), recovery (the fault to the victim healed and back in the
    quorum), and the steps lost (steps the survivors did not commit in between, before the next fault)."""
    faults = [e for e in events if e["event"] == "fault"]
    records = []
    for i, fault in enumerate(faults):
        t0, victim = fault["time"], fault["rank"]
        until = faults[i + 1]["time"] if i + 1 < len(faults) else float("inf")
        later = [e for e in events if t0 <= e["time"] < until and e.get("replica") != victim]
        seen = next((e for e in later if e["event"] == "aborted"
                     or (e["event"] == "members" and e.get("members", 0) < members_before(events, t0))), None)
        healed = next((e for e in events if e["time"] >= t0 and e["event"] == "healed"
                       and e.get("replica") == victim), None)
        end = healed["time"] if healed else float("inf")
        lost = {e["step"] for e in later if e["event"] == "aborted" and e["time"] <= end}
        records.append({"kind": fault["kind"], "rank": victim, "step": fault["step"],
                        "detection_seconds": seen["time"] - t0 if seen else None,
                        "recovery_seconds": healed["time"] - t0 if healed else None,
                        "steps_lost": len(lost)})
    return records


def members_before(events: list[dict[str, Any]], t0: float) -> int:
    counts = [e["members"] for e in events if e["event"] == "members" and e["time"] < t0]
    return counts[-1] if counts else 0



def record_ps_faults(out: Path, injected: list[InjectedFault]) -> None:
    """A parameter-server job's ``faults`` in summary.json (through its writer), from its fault log: per
    injected fault, detection (the fault to the first server that dropped the worker), recovery (the fault to
    the first update the servers applied after that: the job going on without it; workers are not
    restarted), the steps lost (the victim's steps no push committed) and whether its batches were handed over."""
    events = ft.read_events(out / ft.EVENTS_FILE)
    fired = [e for e in events if e["event"] == "fault"]
    if not injected and not fired:
        return
    RunWriter(out, clean=False).merge_summary({K.faults: [ps_fault_record(fault, events) for fault in fired]})
    if len(fired) < len(injected):
        log.warning("%d --inject-fault fault(s) never fired: the job ended first", len(injected) - len(fired))


def ps_fault_record(fault: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    if fault.get("server"):
        return server_fault_record(fault, events)
    t0, victim = fault["time"], fault["rank"]
    dead = next((e for e in events if e["event"] == "dead" and e["worker"] == victim and e["time"] >= t0), None)
    resumed = next((e for e in events if e["event"] == "resumed" and dead and e["time"] >= dead["time"]), None)
    handed = [e for e in events if e["event"] == "handover" and victim in e["owners"] and e["time"] >= t0]
    return {"kind": fault["kind"], "rank": victim, "step": fault["step"],
            "detection_seconds": dead["time"] - t0 if dead else None,
            "recovery_seconds": resumed["time"] - t0 if resumed else None,
            "steps_lost": fault.get("steps_lost"), "handed_over": bool(handed)}


def server_fault_record(fault: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """A killed server shard: detection (the fault to the first worker that lost it), recovery (to the shard
    restored from the last epoch's checkpoint in the restarted job, or back at all when the job restarted before
    its first checkpoint; None without ``--max-restarts``) and the steps lost, counted in the shard's updates (those
    it had applied since that checkpoint)."""
    t0, shard = fault["time"], fault["rank"]
    lost = next((e for e in events if e["event"] == "server_lost" and e["time"] >= t0), None)
    back = [e for e in events if e["event"] in ("restored", "restarted") and e["shard"] == shard and e["time"] >= t0]
    restored = next((e for e in back if e["event"] == "restored"), back[0] if back else None)
    return {"kind": fault["kind"], "rank": shard, "server": True, "step": fault["step"],
            "detection_seconds": lost["time"] - t0 if lost else None,
            "recovery_seconds": restored["time"] - t0 if restored else None,
            "steps_lost": fault["version"] - restored.get("version", 0) if restored else None, "handed_over": False}
