"""`--hosts FILE`: the seeds' ``-H hosts`` form. One host per line (``host`` or ``host slots=N``; ``#``
comments). trainscale prints the command each machine must run (node i = line i; the first host
hosts the rendezvous and the run folder) or, with ``--ssh``, runs them itself over ssh.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.errors import ConfigError
from trainscale.app.config import TrainConfig
from trainscale.app.launch import DEFAULT_MULTINODE_ID, to_argv

DEFAULT_PORT = 29400  # torch's default c10d rendezvous port
_LINE = re.compile(r"^(?P<host>[^\s#]+)(?:\s+slots=(?P<slots>\d+))?\s*$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int | None = None


def parse_hosts(path: str | Path) -> list[Host]:
    """Read a hosts file; a malformed line is an error naming the file and line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--hosts {path}: {exc.strerror}") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if not match or match["slots"] == "0":
            raise ConfigError(f"{path}:{number}: expected 'host' or 'host slots=N', got '{raw.strip()}'")
        hosts.append(Host(match["host"], int(match["slots"]) if match["slots"] else None))
    if not hosts:
        raise ConfigError(f"--hosts {path} lists no hosts")
    if len({h.slots for h in hosts}) > 1:
        raise ConfigError(f"--hosts {path}: every host needs the same slots= (batches are split evenly over workers)")
    return hosts


def node_commands(cfg: TrainConfig, flags: dict[str, Any], hosts: list[Host]) -> list[tuple[str, list[str]]]:
    """(host, argv) for each node: the same flags plus its place in the job."""
    endpoint = cfg.rdzv_endpoint or f"{hosts[0].name}:{DEFAULT_PORT}"
    common = {k: v for k, v in flags.items() if k not in ("hosts", "ssh", "node_rank", "nnodes")}
    out = []
    for rank, host in enumerate(hosts):
        node = {**common, "workers": host.slots or cfg.workers, "nnodes": len(hosts), "node_rank": rank,
                "rdzv_endpoint": endpoint, "rdzv_id": cfg.rdzv_id or DEFAULT_MULTINODE_ID}
        out.append((host.name, ["trainscale", "train", *to_argv(node)]))
    return out


def ssh_argv(host: str, argv: list[str], cwd: str) -> list[str]:
    """``ssh HOST 'cd CWD && trainscale train ...'`` (BatchMode: fail instead of prompting)."""
    return ["ssh", "-o", "BatchMode=yes", host, f"cd {shlex.quote(cwd)} && {shlex.join(argv)}"]


def run_over_ssh(commands: list[tuple[str, list[str]]]) -> int:
    """Start every node's command, wait for all; the job's status is the worst node's."""
    procs = [subprocess.Popen(ssh_argv(host, argv, os.getcwd())) for host, argv in commands]
    return max(p.wait() for p in procs)


def hosts_main(cfg: TrainConfig, flags: dict[str, Any]) -> int:
    commands = node_commands(cfg, flags, parse_hosts(cfg.hosts))
    if cfg.ssh:
        return run_over_ssh(commands)
    print(f"# run on each machine (node 0 = {commands[0][0]} hosts the rendezvous and the run folder):")
    for rank, (host, argv) in enumerate(commands):
        print(f"# node {rank}: {host}\n{shlex.join(argv)}")
    sys.stdout.flush()
    return 0
