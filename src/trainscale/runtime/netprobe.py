"""Probe helper run inside a cluster's namespaces (by file path, stdlib only, see ``cluster.probe_helper``).

``serve ADDR``: listen on ADDR (a free port, printed on stdout), answer one ping-pong connection (echo every
byte) and one bulk connection (count bytes to EOF, then reply with the count), then exit.
``client ADDR PORT NBYTES PINGS``: median round trip of PINGS one-byte exchanges and the time to push NBYTES
one way until the server confirms it has them all; prints one JSON object.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import sys
import time

CHUNK = 64 * 1024


def _connection(listener: socket.socket) -> socket.socket:
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def serve(host: str) -> None:
    with socket.create_server((host, 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        with _connection(listener) as conn:
            while byte := conn.recv(1):
                conn.sendall(byte)
        with _connection(listener) as conn:
            total = 0
            while data := conn.recv(CHUNK):
                total += len(data)
            conn.sendall(struct.pack("!Q", total))


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def ping_pong(host: str, port: int, pings: int) -> float:
    """Median round trip in seconds."""
    times = []
    with _connect(host, port) as sock:
        for _ in range(pings):
            start = time.perf_counter()
            sock.sendall(b"x")
            if sock.recv(1) != b"x":
                raise ConnectionError("probe server closed the ping-pong connection")
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def bulk(host: str, port: int, nbytes: int) -> float:
    """Seconds from the first byte sent until the server confirms it received all ``nbytes``."""
    payload = b"\0" * CHUNK
    with _connect(host, port) as sock:
        start = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= sock.send(payload[: min(left, CHUNK)])
        sock.shutdown(socket.SHUT_WR)
        (received,) = struct.unpack("!Q", sock.recv(8))
        seconds = time.perf_counter() - start
    if received != nbytes:
        raise ConnectionError(f"server received {received} of {nbytes} bytes")
    return seconds


def client(host: str, port: int, nbytes: int, pings: int) -> dict:
    rtt = ping_pong(host, port, pings)
    seconds = bulk(host, port, nbytes)
    return {"rtt_seconds": rtt, "bytes": nbytes, "seconds": seconds, "bits_per_second": nbytes * 8 / seconds}


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 2:
        serve(argv[1])
        return 0
    if argv[:1] == ["client"] and len(argv) == 5:
        try:
            print(json.dumps(client(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))))
        except OSError as exc:  # the reason in one line, for the error `cluster probe` prints
            print(exc.strerror or exc, file=sys.stderr)
            return 1
        return 0
    print("usage: netprobe.py serve ADDR | client ADDR PORT NBYTES PINGS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
