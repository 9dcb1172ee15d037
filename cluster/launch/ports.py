"""Ports chosen now for a listener that starts later (a redis-server, HAProxy, a test's
`pdserve serve`): free now, and from a range that no other process takes by chance in
between. The OS hands out its ephemeral range (ip_local_port_range) to every bind(0) and
every outgoing connection, and Ray's processes make many while a cluster starts: a port
chosen there was taken first more than once (in CI: a dashboard agent took HAProxy's
metrics port; HAProxy then "cannot bind socket", and the cluster had no ingress)."""

from __future__ import annotations

import random
import socket

# Above Ray's worker ports (10002-19999), below Serve's direct-ingress ports (from 30000).
SAFE_PORTS = range(20000, 30000)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(besides: int | None = None) -> int:
    """A port free now on every interface, in SAFE_PORTS outside the OS's ephemeral range."""
    low, high = ephemeral_ports()
    candidates = [p for p in SAFE_PORTS if not low <= p <= high and p != besides]
    random.shuffle(candidates)  # two clusters (or tests) started together do not try the same ports
    for port in candidates:
        if port_free("0.0.0.0", port):
            return port
    with socket.socket() as s:  # all taken: the OS's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on (host, port) now: no socket listens there. Bound as
    the servers bind (HAProxy, uvicorn and gRPC set SO_REUSEADDR), so that the connections
    of a server just stopped, in TIME_WAIT for a minute, do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_ports() -> tuple[int, int]:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):  # not Linux: the IANA range
        low, high = 49152, 65535
    return low, high
