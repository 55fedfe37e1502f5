"""Where a job listens, and checks on the rendezvous address made before any worker starts, so mistakes
are one clear line instead of a rendezvous timeout minutes later.

Every listener of a job (the rendezvous store, the workers' store, gloo, TensorPipe) is bound to one
address: 127.0.0.1 for a job on one machine, and for a job over several machines the address of this
machine's interface toward the rendezvous host. torch's own stores bind every interface (``[::]``), so
trainscale hands them a socket it bound itself (``listening_socket``).
"""

from __future__ import annotations

import errno
import fcntl
import random
import socket
import struct
import time
from pathlib import Path

from trainscale.errors import ConfigError

LOCALHOST = "127.0.0.1"
LISTEN_BACKLOG = 512  # every worker of a large job connects to the stores at once
_SIOCGIFADDR = 0x8915
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 10_000  # free_port's ports: from here to the kernel's ephemeral range
_PICKS = 32


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port`` too) -> (host, port)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint must be HOST:PORT (port 1-65535), got '{text}'")
    return host.strip("[]"), int(port)


def free_port(host: str = LOCALHOST) -> int:
    """A port free right now, for a listener that binds it later (another process, say), picked below the kernel's
    ephemeral range where there is room: a port from that range can be handed to any process's outgoing connection
    before the listener binds it, one below it only to a program that asks for it by number. Another process can
    still take it; a listener that can bind at once should hold its socket instead (``listening_socket``)."""
    low = _ephemeral_low()
    if low - LOWEST_PICKED_PORT >= _PICKS:
        for port in random.SystemRandom().sample(range(LOWEST_PICKED_PORT, low), _PICKS):
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 0 where it cannot be read: no room below it)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_port_free(host: str, port: int) -> None:
    """Node 0 will listen on ``host:port``: refuse a port in use or an address of another machine."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--rdzv-endpoint host '{host}' does not resolve ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise _bind_error(exc, host, port) from None


def _bind_error(exc: OSError, host: str, port: int) -> ConfigError:
    if exc.errno == errno.EADDRINUSE:
        other = free_port(LOCALHOST)
        return ConfigError(
            f"port {port} on {host} is busy; pass --rdzv-endpoint {host}:OTHER (e.g. {host}:{other} is free now)"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(
            f"--rdzv-endpoint host '{host}' is not an address of this machine, but node 0 hosts "
            "the rendezvous: run --node-rank 0 on that host, or give this machine's address"
        )
    return ConfigError(f"cannot listen on {host}:{port} for the rendezvous: {exc.strerror}")


def wait_reachable(host: str, port: int, timeout_s: float) -> None:
    """Nodes other than 0 wait (up to ``timeout_s``) for node 0's rendezvous to accept connections."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.2, min(2.0, remaining))):
                return
        except OSError as exc:
            if time.monotonic() + 0.5 >= deadline:
                reason = exc.strerror or type(exc).__name__
                raise ConfigError(
                    f"cannot reach the rendezvous endpoint {host}:{port} within {timeout_s:g} s "
                    f"({reason}); start node 0 first, check the address and firewall, or raise "
                    "--rdzv-timeout"
                ) from None
            time.sleep(0.5)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only (``port`` 0: any free port), for a store to serve on."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def local_address_toward(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing; it only picks the route)."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of the network interface that holds ``address`` (gloo and TensorPipe bind by interface name)."""
    for _, name in socket.if_nameindex():
        if address in _addresses_of(name):
            return name
    raise ConfigError(
        f"no network interface of this machine has the address {address}; give an address of "
        "this machine in --rdzv-endpoint (node 0) or check the routes to it"
    )


def _addresses_of(name: str) -> set[str]:
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            found.add(socket.inet_ntoa(packed[20:24]))
        except OSError:  # an interface with no IPv4 address
            pass
    inet6 = Path("/proc/net/if_inet6")
    for line in inet6.read_text().splitlines() if inet6.exists() else []:
        fields = line.split()
        if fields[-1] == name:
            found.add(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0])))
    return found


def interface_counters(interface: str) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``interface`` since it came up, as the kernel counts them: every
    frame, headers and retransmissions included. Inside ``ip netns exec`` /sys shows that namespace's devices."""
    stats = Path("/sys/class/net") / interface / "statistics"
    try:
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())
    except OSError as exc:
        raise ConfigError(f"no counters for network interface {interface} ({exc.strerror})") from None
