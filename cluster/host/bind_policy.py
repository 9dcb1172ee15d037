"""What a cluster on this machine listens on: its API on the address the user asked for
(`pdserve serve --host`, loopback by default), everything else on loopback.

A local Ray needs none of its own ports reachable from another host, yet Ray 2.60 and
Serve listen on every interface by default (24 sockets under a default `pdserve serve`).
Each kind of listener is brought in where it is made:

- Ray's own (GCS, raylet, the workers' gRPC, object manager, dashboard and runtime-env
  agents, the metrics exporter) bind the node IP when it is the loopback address. A Ray
  in single-node mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, what Ray runs on macOS and
  Windows) takes it as its node IP: cluster/host/local_ray.py starts every local Ray so.
- Serve binds some listeners whatever its options say: its gRPC servers (the proxy's, a
  replica's direct-ingress and inter-deployment ones) bind `[::]`, its HTTP servers (the
  proxy's, the direct-ingress replicas') the API's host, and HAProxy's metrics and stats
  frontends `*`. `apply` rebinds them in every worker process of the local Ray (Ray's
  `worker_process_setup_hook`, which runs before any actor does): a listener on an API
  port (the proxies' own, with `--ingress proxy`) binds the API host, any other loopback.
  HAProxy's API frontends keep Serve's rendering: the API host.
- pdserve's own (the gateways' delta channels, the KV pairs' and TP groups' rendezvous
  stores and gloo's pairs) bind the node IP (cluster/host/rendezvous.py).

A cluster of `ray start` nodes is left as it is: its nodes must reach one another, and
Ray's token authentication guards its control plane (deploy/README.md).
"""

from __future__ import annotations

import importlib
import ipaddress
import os
import socket
from collections.abc import Callable, Iterable

LOOPBACK = "127.0.0.1"
API_HOST_ENV = "PDSERVE_API_HOST"
API_PORTS_ENV = "PDSERVE_API_PORTS"
WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})

# HAProxy's listeners besides the API frontends, as Serve 2.60's template binds them.
HAPROXY_BINDS = (
    ("bind :{{ config.metrics_port }}", f"bind {LOOPBACK}:{{{{ config.metrics_port }}}}"),
    ("bind *:{{ config.stats_port }}", f"bind {LOOPBACK}:{{{{ config.stats_port }}}}"),
)


class BindPolicyError(RuntimeError):
    """The installed Ray Serve binds where this policy cannot reach (a Ray other than the pinned one)."""


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (an unknown name is not)."""
    try:
        return _loopback_address(host.strip("[]"))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(_loopback_address(info[4][0]) for info in infos)


def _loopback_address(text: str) -> bool:
    address = ipaddress.ip_address(text)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, as a dual-stack socket shows an IPv4 peer
    return (mapped or address).is_loopback


def runtime_env(api_host: str, api_ports: Iterable[int]) -> dict:
    """A local Ray's job runtime_env: `apply` in every worker process, with the API's address."""
    return {
        "worker_process_setup_hook": f"{__name__}.apply",
        "env_vars": {API_HOST_ENV: api_host, API_PORTS_ENV: ",".join(str(p) for p in api_ports)},
    }


def apply() -> None:
    """Rebind Serve's listeners in this process (a worker of a local Ray): on the API host if
    their port is an API port, else on loopback. Raises BindPolicyError rather than leave one
    where it was."""
    api_host = os.environ[API_HOST_ENV]
    api_ports = {int(p) for p in os.environ[API_PORTS_ENV].split(",") if p}

    def host_for(port: int) -> str:
        return api_host if port in api_ports else LOOPBACK

    def grpc_address(address: str) -> str:
        host, _, port = address.rpartition(":")
        if host not in WILDCARDS:
            return address
        chosen = host_for(int(port))
        return f"[{chosen}]:{port}" if ":" in chosen else f"{chosen}:{port}"

    def grpc_port(add_port: Callable) -> Callable:
        def add_port_on_policy_host(server, address: str):
            return add_port(server, grpc_address(address))

        return add_port_on_policy_host

    def http_server(start: Callable) -> Callable:
        async def start_on_policy_host(app, http_options, *args, **kwargs):
            options = http_options.model_copy(update={"host": host_for(http_options.port)})
            return await start(app, options, *args, **kwargs)

        return start_on_policy_host

    # Each function is replaced where it is defined and where Serve's modules imported it by name.
    _replace("ray._common.tls_utils", "add_port_to_grpc_server", grpc_port, users=("ray.serve._private.replica",))
    _replace("ray.serve._private.default_impl", "add_grpc_address", grpc_port, users=())
    _replace("ray.serve._private.http_util", "start_asgi_http_server", http_server,
             users=("ray.serve._private.replica", "ray.serve._private.proxy"))
    haproxy = importlib.import_module("ray.serve._private.haproxy")
    template = haproxy.HAPROXY_CONFIG_TEMPLATE
    for old, new in HAPROXY_BINDS:
        if old not in template and new not in template:
            raise BindPolicyError(f"Ray Serve's HAProxy template has no {old!r}: its listeners cannot be kept on loopback")
        template = template.replace(old, new)
    haproxy.HAPROXY_CONFIG_TEMPLATE = template


def _replace(module_name: str, name: str, wrap: Callable[[Callable], Callable], users: tuple[str, ...]) -> None:
    module = importlib.import_module(module_name)
    original = getattr(module, name, None)
    if original is None:
        raise BindPolicyError(f"{module_name}.{name} is gone: Ray Serve's listeners cannot be kept on loopback")
    if getattr(original, "__wrapped_by_bind_policy__", False):
        return  # applied already (a worker process runs the hook once; tests may call it again)
    wrapped = wrap(original)
    wrapped.__wrapped_by_bind_policy__ = True
    setattr(module, name, wrapped)
    for user_name in users:
        user = importlib.import_module(user_name)  # (if first imported now, it took `wrapped` already)
        if getattr(user, name, None) not in (original, wrapped):
            raise BindPolicyError(f"{user_name} no longer imports {module_name}.{name}: its listener cannot be kept on loopback")
        setattr(user, name, wrapped)
