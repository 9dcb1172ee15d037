"""Serve's listeners rebound by cluster/host/bind_policy.py, in a fresh interpreter as a local Ray's
worker process runs it: a gRPC server Serve would bind on every interface listens on loopback,
an API port on the API host, and HAProxy's metrics and stats frontends bind loopback."""

import json
import subprocess
import sys
import textwrap

import pytest

from cluster.host.bind_policy import is_loopback
from cluster.launch.ports import free_port

PROBE = textwrap.dedent("""
    import asyncio, json, os, psutil
    os.environ.update(PDSERVE_API_HOST="0.0.0.0", PDSERVE_API_PORTS=str(API_PORT))
    from cluster.host import bind_policy
    bind_policy.apply()
    bind_policy.apply()  # a second time changes nothing
    import grpc
    from ray.serve._private import default_impl, haproxy, replica

    async def bound() -> list:
        inter = grpc.aio.server()
        replica.add_port_to_grpc_server(inter, "[::]:0")  # a replica's inter-deployment server
        api = grpc.aio.server()
        default_impl.add_grpc_address(api, f"[::]:{API_PORT}")  # the proxy's gRPC API port
        await inter.start()
        await api.start()
        mine = [c.laddr for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid == os.getpid()]
        await inter.stop(None)
        await api.stop(None)
        return [[ip, port] for ip, port in mine]

    print(json.dumps({"bound": asyncio.run(bound()), "template": haproxy.HAPROXY_CONFIG_TEMPLATE}))
""")


def test_serve_listeners_bind_loopback_but_the_api_ports():
    api_port = free_port()
    r = subprocess.run([sys.executable, "-c", f"API_PORT = {api_port}\n" + PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    by_port = {port: ip for ip, port in out["bound"]}
    assert by_port.pop(api_port) in ("0.0.0.0", "::")  # (gRPC takes 0.0.0.0 for every interface, IPv6 too)
    assert len(by_port) == 1 and is_loopback(next(iter(by_port.values()))), out["bound"]
    template = out["template"]
    assert "bind 127.0.0.1:{{ config.metrics_port }}" in template and "bind 127.0.0.1:{{ config.stats_port }}" in template
    assert "bind :{{" not in template and "bind *:{{" not in template
    assert "bind {{ config.frontend_host }}:{{ config.frontend_port }}" in template  # the API's frontends: as Serve renders them


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("::ffff:127.0.0.1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("no-such-host.invalid", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) == loopback
