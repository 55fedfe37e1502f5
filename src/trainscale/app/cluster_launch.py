"""`trainscale train --cluster NAME`: the same job as on real machines, one node per emulated host.

The parent (what the user ran) runs the pre-flight (``app.preflight``: the cluster is up, the mode's checks
with its hosts, the devices, the model's input, the run folder, the data) before any node starts, then starts
on host i, inside its network namespace, ``python -m trainscale train <the same flags> --nnodes N --node-rank i
--rdzv-endpoint 10.77.0.1:29400 --out OUT``: each node is an ordinary node of a multi-machine job
(``app.launch``), so the rendezvous is at host 0's address and every listener is bound to the host's own
interface, exactly as across real machines.

Cores: the hosts share this machine's, so each host gets an equal share: ``--threads`` per worker from it,
and where the cgroup-v1 cpu controller is there, a CFS quota of that many CPUs per host
(``runtime.cluster.cpu_quotas``). Both are recorded in summary.json's ``cluster`` with the rates and the
measured round trip; the workers add the kernel's bytes on the wire (``cluster.seam``).

Nodes run in sessions of their own and die with this process (parent-death signal). When one fails, the
others are stopped and only the failed node's messages are shown; Ctrl-C stops them all with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from trainscale.app.config import TrainConfig, one_batch
from trainscale.app.hosts import Host, node_commands
from trainscale.app.preflight import preflight
from trainscale.io import read_json
from trainscale.record import SUMMARY, K
from trainscale.runtime import cluster as net
from trainscale.runtime.cpus import cpu_count
from trainscale.runtime.job import NODE_REPORT_ENV
from trainscale.runtime.orphans import die_with_parent, sigterm_as_interrupt
from trainscale.stops import stop_report, stops_held

STOP_GRACE_S = 15.0
FAILURE_SETTLE_S = 3.0
POLL_S = 0.2
ERROR_PREFIX = "trainscale train: error: "


def host_share(record: dict[str, Any], cfg: TrainConfig) -> tuple[float, int]:
    """(CPUs per host, threads per process): this machine's cores split evenly over the hosts, and each
    host's share over its processes (``--threads`` wins when given)."""
    cpus = cpu_count() / record["hosts"]
    processes = cfg.launch.local_workers + cfg.ps.servers
    return cpus, cfg.run.threads or max(1, int(cpus // processes))


def facts(record: dict[str, Any], threads: int, cpus: float | None) -> dict[str, Any]:
    """The cluster as summary.json records it (``cpus_per_host`` None: no quota could be set)."""
    return {
        "name": record["name"],
        "hosts": record["hosts"],
        "rate_bps": min(record["rates_bps"]),
        "rates_bps": record["rates_bps"],
        "rtt_seconds": record.get("rtt_seconds"),
        "interface": net.HOST_DEV,
        "threads_per_process": threads,
        "cpus_per_host": cpus,
        **({"dilation": record["dilation"]} if record.get("dilation") else {}),
    }


def resolved_flags(cfg: TrainConfig) -> dict[str, Any]:
    """Every resolved setting, as flags, so that each node resolves exactly this run: a setting left out because
    it equals the field's default would be filled again by the recipe (an explicit ``label_smoothing = 0.0`` came
    back as the airbench recipe's 0.2). A node must not read ``--config`` again, where ``cluster`` (or a bench's
    ``cluster_hosts``) would send it back here."""
    return one_batch({k: v for k, v in cfg.to_dict().items() if v is not None and k not in ("config", "cluster")})


def cluster_main(cfg: TrainConfig) -> int:
    """Run the job with one node per host of ``cfg.launch.cluster``; the nodes get the resolved settings as flags."""
    checked = preflight(cfg)  # for the whole world: the cluster's hosts are its nodes
    record, out = checked.cluster, checked.out
    assert record is not None and out is not None
    cpus, threads = host_share(record, cfg)
    hosts = [Host(address) for address in record["addresses"]]
    commands = node_commands(cfg, {**resolved_flags(cfg), "out": str(out), "threads": threads}, hosts)
    with net.cpu_quotas(record["name"], record["hosts"], cpus) as groups, tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, net.CLUSTER_ENV: json.dumps(facts(record, threads, cpus if groups else None))}
        argvs = [
            net.in_namespace(record["name"], i, [sys.executable, "-m", "trainscale", *argv[1:]])
            for i, (_, argv) in enumerate(commands)
        ]
        status = Nodes(argvs, env, groups, Path(tmp)).run()
    if status == 0:
        summary = read_json(out / SUMMARY)
        print(wire_line(summary))
        if summary.get(K.projected):
            print(projected_line(summary))
    return status


def wire_line(summary: dict[str, Any]) -> str:
    c = summary[K.cluster]
    rtt = f"{c['rtt_seconds'] * 1e3:.3f} ms" if c.get("rtt_seconds") is not None else "not measured"
    text = f"cluster {c['name']}: {c['hosts']} hosts at {net.format_rate(c['rate_bps'])}, round trip {rtt}"
    wire, counted = summary.get(K.wire_bytes_sent_per_step), summary.get(K.bytes_sent_per_step)
    if wire is not None:
        text += f"; each host's interface sent {wire / 2**20:.3f} MiB per step"
        if counted:
            text += f" ({wire / counted:.2f}x the {counted / 2**20:.3f} MiB handed to collectives)"
    return text


def projected_line(summary: dict[str, Any]) -> str:
    """The run's figures on the target cluster of a time-dilated emulation."""
    p = summary[K.projected]
    parts = [
        f"step {1e3 * p[K.step_seconds]:.1f} ms" if p.get(K.step_seconds) else None,
        f"{p[K.samples_per_sec]:,.0f} images/s" if p.get(K.samples_per_sec) else None,
        f"{p[K.steady_epoch_seconds]:.2f} s per epoch" if p.get(K.steady_epoch_seconds) else None,
    ]
    return f"projected to {p['target']} (times / {p['factor']:.3g}): " + ", ".join(x for x in parts if x)


class Nodes:
    """The node processes of one job: started, watched, and always stopped. Each node's own error line is
    held back: when several fail, the parent names the root cause once (``root_cause``)."""

    def __init__(self, argvs: list[list[str]], env: dict[str, str], groups: list[Path] | None, reports: Path) -> None:
        self.argvs, self.env, self.groups, self.reports = argvs, env, groups, reports
        self.procs: list[subprocess.Popen] = []
        self.relays: list[threading.Thread] = []
        self.held: dict[int, str] = {}
        self.shown: set[int] | None = None  # None: every node's messages; else only these nodes'

    def run(self) -> int:
        try:
            with sigterm_as_interrupt():
                for index, argv in enumerate(self.argvs):
                    self.start(index, argv)
                return self.wait()
        except KeyboardInterrupt as stop:
            self.shown = set()
            word, status = stop_report(stop)
            print(f"trainscale train: {word}; every node of the cluster job was stopped", file=sys.stderr)
            return status
        finally:
            self.stop()

    def start(self, index: int, argv: list[str]) -> None:
        group = self.groups[index] if self.groups else None
        env = {**self.env, NODE_REPORT_ENV: str(self.report_path(index))}
        with stops_held():  # a stop while the node starts comes once it is in ``procs``, so ``stop`` ends it too
            proc = subprocess.Popen(
                argv,
                env=env,
                stdout=None if index == 0 else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_node_setup(group),
            )
            self.procs.append(proc)
        relay = threading.Thread(target=self.relay, args=(index, proc.stderr), daemon=True)
        relay.start()
        self.relays.append(relay)

    def report_path(self, index: int) -> Path:
        return self.reports / f"node{index}.json"

    def relay(self, index: int, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace")
            if line.startswith(ERROR_PREFIX):
                self.held[index] = line[len(ERROR_PREFIX) :].strip()
            elif self.shown is None or index in self.shown:
                sys.stderr.write(line)
                sys.stderr.flush()

    def wait(self) -> int:
        """0 once node 0 (which owns the run folder) exited 0; else the root cause's status, named once.
        From then on the other nodes' messages are muted: after a failure they only echo it, and after
        node 0 finished they can only complain that its rendezvous store is gone."""
        while True:
            codes = [p.poll() for p in self.procs]
            if codes[0] == 0:
                self.shown = {0}
                self.relays[0].join(timeout=STOP_GRACE_S)
                self.settle(STOP_GRACE_S)
                return 0
            if any(code not in (None, 0) for code in codes):
                self.shown = set()
                self.settle(FAILURE_SETTLE_S)  # the others fail too, moments later: then all can be compared
                message, status = self.root_cause()
                print(f"{ERROR_PREFIX}{message}", file=sys.stderr)
                return status
            time.sleep(POLL_S)

    def root_cause(self) -> tuple[str, int]:
        """(line, status) of the node whose failure caused the others': the nodes' own triage (each writes
        whether its failure was a consequence, and when), else the first node that failed."""
        for relay in self.relays:
            relay.join(timeout=1.0)
        reports = {i: read_json(self.report_path(i)) for i in range(len(self.procs)) if self.report_path(i).is_file()}
        if reports:
            index = min(reports, key=lambda i: (reports[i]["consequence"], reports[i]["time_ns"], i))
            return f"node {index}: {reports[index]['message']}", int(reports[index]["status"])
        index = next(i for i, p in enumerate(self.procs) if p.poll() not in (None, 0))
        code = self.procs[index].returncode
        return f"node {index}: {self.held.get(index) or f'exited with status {code}'}", code if code > 0 else 1

    def settle(self, seconds: float) -> None:
        """Give the other nodes ``seconds`` to end by themselves before ``stop`` ends them."""
        _wait_for(self.procs, seconds)

    def stop(self) -> None:
        """SIGTERM to every node still running (its agent stops its workers), SIGKILL after a grace period."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs if p.poll() is None]
            for proc in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            _wait_for(alive, STOP_GRACE_S)
        for relay in self.relays:
            relay.join(timeout=1.0)


def _wait_for(procs: list[subprocess.Popen], seconds: float) -> None:
    """Until every one of ``procs`` has exited, or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _node_setup(group: Path | None) -> Callable[[], None]:
    """Run in each node's process before it execs: die with this process; join its host's CPU group."""

    def setup() -> None:
        die_with_parent(signal.SIGTERM)
        if group is not None:
            net.join_cpu_group(group)

    return setup
