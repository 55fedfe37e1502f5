"""Nobody in: every socket a job listens on is bound to loopback on one machine, and to the address the
user gave (its interface) across machines, never to every interface.

The listeners are read from /proc while the job runs: each LISTEN socket of /proc/net/tcp{,6} whose inode
is an open file of a process of the job (the launcher and all its descendants).
"""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from trainscale.runtime.network import free_port, interface_of, listening_socket, local_address_toward
from trainscale.runtime.rendezvous import bound_store, held_endpoint

SMALL = (
    "--model",
    "mlp",
    "--dataset",
    "synthetic",
    "--train-subset",
    "2048",
    "--test-subset",
    "256",
    "--epochs",
    "3",
    "--batch-size",
    "64",
    "--no-progress",
    "--threads",
    "1",
)
LISTEN = "0A"


def _listening_inodes(pid: int) -> dict[str, str]:
    """inode -> local address of every TCP socket in LISTEN state in ``pid``'s network namespace."""
    found = {}
    for table, width in ((f"/proc/{pid}/net/tcp", 4), (f"/proc/{pid}/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:  # the process ended meanwhile
            return found
        for line in lines:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            hex_addr = fields[1].split(":")[0]
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            found[fields[9]] = str(ipaddress.ip_address(packed))
    return found


def _tree(root: int) -> set[int]:
    """``root`` and every live descendant."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # the process ended meanwhile
        pass
    return inodes


def listeners_while_running(proc: subprocess.Popen, timeout: float = 240) -> dict[str, str]:
    """socket inode -> address of every socket a process of ``proc``'s tree listened on, sampled until it exits."""
    seen: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in _tree(proc.pid):
            listening = _listening_inodes(pid)
            seen.update({i: listening[i] for i in _socket_inodes(pid) if i in listening})
        time.sleep(0.05)
    return seen


def run_job(*args: str, prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict[str, str], str]:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "trainscale", "train", *SMALL, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        seen = listeners_while_running(proc)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, seen, output


def test_listening_socket_binds_only_the_given_address() -> None:
    with listening_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    assert interface_of(local_address_toward("127.0.0.1")) == "lo"


def _bind_error(port: int) -> int | None:
    """The errno another process's bind of ``127.0.0.1:port`` meets (None: it would get the port)."""
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno
    return None


def test_a_held_endpoint_is_nobody_elses_until_the_store_serves_on_it() -> None:
    """A job on one machine picks its rendezvous port and keeps listening on it until torch's agent creates the
    store there: nobody can take it in between (before, a port found free could be gone at the store's bind, a
    failed start on a busy machine)."""
    timeout = datetime.timedelta(seconds=10)
    with held_endpoint("127.0.0.1") as endpoint:
        port = int(endpoint.rsplit(":", 1)[1])
        assert _bind_error(port) == errno.EADDRINUSE
        server = bound_store("127.0.0.1", port, True, timeout)
        client = bound_store("127.0.0.1", port, False, timeout)
        client.set("k", "v")
        assert server.get("k") == b"v"
        del client, server
    with held_endpoint("127.0.0.1") as endpoint:  # no store took it: closed on the way out
        port = int(endpoint.rsplit(":", 1)[1])
    assert _bind_error(port) is None


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_single_machine_job_listens_on_loopback_only(tmp_path: Path, mode: str) -> None:
    extra = ("--servers", "1") if mode == "async" else ()
    proc, seen, output = run_job("--mode", mode, "--workers", "2", *extra, "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, output[-3000:]
    # the rendezvous store, the workers' store and gloo's (sync) or TensorPipe's (async) listeners at least
    assert len(seen) >= 3, seen
    assert set(seen.values()) == {"127.0.0.1"}, f"listeners outside loopback: {seen}"


NS = ("ts-l0-" + uuid.uuid4().hex[:6], "ts-l1-" + uuid.uuid4().hex[:6])
ADDRESSES = ("10.213.7.1", "10.213.7.2")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair (10.213.7.1 and .2); always deleted afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    try:
        for ns in NS:
            _ip("netns", "add", ns)
        _ip("link", "add", "tsl0", "netns", NS[0], "type", "veth", "peer", "name", "tsl1", "netns", NS[1])
        for ns, dev, address in zip(NS, ("tsl0", "tsl1"), ADDRESSES):
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield NS
    finally:
        for ns in NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.dist
def test_two_machine_job_listens_on_the_given_address_only(tmp_path: Path, two_hosts: tuple[str, str]) -> None:
    endpoint = f"{ADDRESSES[0]}:{free_port()}"
    common = ("--nnodes", "2", "--rdzv-endpoint", endpoint, "--workers", "1", "--rdzv-timeout", "120")
    node1 = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            two_hosts[1],
            sys.executable,
            "-m",
            "trainscale",
            "train",
            *SMALL,
            *common,
            "--node-rank",
            "1",
            "--out",
            str(tmp_path / "node1"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        proc, seen, output = run_job(
            *common, "--node-rank", "0", "--out", str(tmp_path / "run"), prefix=("ip", "netns", "exec", two_hosts[0])
        )
        node1_output = node1.communicate(timeout=120)[0]
    finally:
        if node1.poll() is None:
            node1.kill()
    assert proc.returncode == 0, output[-3000:]
    assert node1.returncode == 0, node1_output[-3000:]
    assert len(seen) >= 3, seen
    assert set(seen.values()) == {ADDRESSES[0]}, f"node 0 listened on {seen}"
    assert (tmp_path / "run" / "summary.json").exists()


def test_interface_of_an_unknown_address_is_one_line() -> None:
    from trainscale.errors import ConfigError

    with pytest.raises(ConfigError, match="no network interface"):
        interface_of("192.0.2.123")
    assert socket.if_nameindex()
