"""`--hosts FILE`: MPI's and MXNet's ``-H hosts`` form. One host per line (``host`` or ``host slots=N``; ``#``
comments). trainscale prints the command each machine must run (node i = line i; the first host
hosts the rendezvous and the run folder) or, with ``--ssh``, runs them itself over ssh.

A host is a host name (letters, digits, ``-``, ``_`` and dots, no label starting with ``-``), an IPv4 or
IPv6 address, or ``user@`` one of those (ssh's usual form; the user is a POSIX login name). Anything else
is refused, so a line can never reach ssh as an option (``-oProxyCommand=...``); ``ssh_argv`` also ends
ssh's options with ``--``. Underscores are allowed because ssh_config ``Host`` aliases often use them.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainscale.app.config import TrainConfig
from trainscale.app.rendezvous import DEFAULT_MULTINODE_ID
from trainscale.app.worker_env import to_argv
from trainscale.errors import ConfigError

DEFAULT_PORT = 29400  # torch's default c10d rendezvous port
_LINE = re.compile(r"^(?P<host>[^\s#]+)(?:\s+slots=(?P<slots>\d+))?\s*$")
_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9._-]{0,31}$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int | None = None

    @property
    def address(self) -> str:
        """The machine without ``user@``: what other nodes connect to (the rendezvous endpoint)."""
        return self.name.rpartition("@")[2]


def host_problem(name: str) -> str | None:
    """Why ``name`` is no ``[user@]host`` (None when it is one): what keeps a hosts line out of ssh's options."""
    user, at, host = name.rpartition("@")
    if at and not _USER.match(user):
        return f"{user!r} is not a user name (letters, digits, '.', '_', '-'; starting with a letter or '_')"
    if _is_address(host) or (len(host) <= 253 and all(_LABEL.match(part) for part in host.split("."))):
        return None
    return f"{host!r} is not a host name or IP address"


def _is_address(text: str) -> bool:
    if "%" in text:  # IPv6 scope ids: free text, not worth the risk
        return False
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def parse_hosts(path: str | Path) -> list[Host]:
    """Read a hosts file; a malformed line is an error naming the file and line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"--hosts {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--hosts {path}: not a text file") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if not match or match["slots"] == "0":
            raise ConfigError(f"{path}:{number}: expected 'host' or 'host slots=N', got '{raw.strip()}'")
        problem = host_problem(match["host"])
        if problem:
            raise ConfigError(f"{path}:{number}: {problem}; a host is [user@]name or an IP address")
        hosts.append(Host(match["host"], int(match["slots"]) if match["slots"] else None))
    if not hosts:
        raise ConfigError(f"--hosts {path} lists no hosts")
    if len({h.slots for h in hosts}) > 1:
        raise ConfigError(f"--hosts {path}: every host needs the same slots= (batches are split evenly over workers)")
    return hosts


def node_commands(cfg: TrainConfig, flags: dict[str, Any], hosts: list[Host]) -> list[tuple[str, list[str]]]:
    """(host, argv) for each node: the same flags plus its place in the job."""
    first = hosts[0].address
    endpoint = cfg.launch.rdzv_endpoint or (f"[{first}]:{DEFAULT_PORT}" if ":" in first else f"{first}:{DEFAULT_PORT}")
    common = {k: v for k, v in flags.items() if k not in ("hosts", "ssh", "cluster", "node_rank", "nnodes")}
    out = []
    for rank, host in enumerate(hosts):
        node = {
            **common,
            "workers": host.slots or cfg.launch.workers,
            "nnodes": len(hosts),
            "node_rank": rank,
            "rdzv_endpoint": endpoint,
            "rdzv_id": cfg.launch.rdzv_id or DEFAULT_MULTINODE_ID,
        }
        out.append((host.name, ["trainscale", "train", *to_argv(node)]))
    return out


def ssh_argv(host: str, argv: list[str], cwd: str) -> list[str]:
    """``ssh -o BatchMode=yes -- HOST 'cd CWD && trainscale train ...'`` (BatchMode: fail instead of
    prompting; ``--``: the host is never read as an option, whatever slipped past ``parse_hosts``)."""
    problem = host_problem(host)
    if problem:
        raise ConfigError(f"ssh: {problem}")
    return ["ssh", "-o", "BatchMode=yes", "--", host, f"cd {shlex.quote(cwd)} && {shlex.join(argv)}"]


def run_over_ssh(commands: list[tuple[str, list[str]]]) -> int:
    """Start every node's command, wait for all; the job's status is the worst node's."""
    procs = [subprocess.Popen(ssh_argv(host, argv, os.getcwd())) for host, argv in commands]
    return max(p.wait() for p in procs)


def hosts_main(cfg: TrainConfig, flags: dict[str, Any]) -> int:
    assert cfg.launch.hosts is not None  # the command dispatches here for --hosts FILE
    commands = node_commands(cfg, flags, parse_hosts(cfg.launch.hosts))
    if cfg.launch.ssh:
        return run_over_ssh(commands)
    print(f"# run on each machine (node 0 = {commands[0][0]} hosts the rendezvous and the run folder):")
    for rank, (host, argv) in enumerate(commands):
        print(f"# node {rank}: {host}\n{shlex.join(argv)}")
    sys.stdout.flush()
    return 0
