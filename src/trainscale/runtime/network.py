"""Checks on the rendezvous address made before any worker starts, so mistakes are one clear line
instead of a rendezvous timeout minutes later."""

from __future__ import annotations

import errno
import socket
import time

from trainscale.errors import ConfigError

LOCALHOST = "127.0.0.1"


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port`` too) -> (host, port)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--rdzv-endpoint must be HOST:PORT (port 1-65535), got '{text}'")
    return host.strip("[]"), int(port)


def free_port(host: str = LOCALHOST) -> int:
    """A port the OS reports free right now (another process could still take it before we do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
        return ConfigError(f"port {port} on {host} is busy; pass --rdzv-endpoint {host}:OTHER "
                           f"(e.g. {host}:{other} is free now)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"--rdzv-endpoint host '{host}' is not an address of this machine, but node 0 hosts "
                           "the rendezvous: run --node-rank 0 on that host, or give this machine's address")
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
                raise ConfigError(f"cannot reach the rendezvous endpoint {host}:{port} within {timeout_s:g} s "
                                  f"({reason}); start node 0 first, check the address and firewall, or raise "
                                  "--rdzv-timeout") from None
            time.sleep(0.5)
