"""A Ray on this machine alone: what pdserve starts when it is given no cluster (`pdserve
serve` and `generate -tp N` without --address, the benchmarks' local targets, the tests).

Every one starts here, with the same settings: Ray's single-node mode, whose node IP is the
loopback address, so that Ray's own processes listen there only; Serve's listeners
rebound by cluster/host/bind_policy.py in every worker process; and the replicas at nice 0
(cluster/config.py: RAY_SYSTEM_CONFIG).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import ray
from ray._private import ray_constants, services

from cluster.config import RAY_SYSTEM_CONFIG
from cluster.host.bind_policy import LOOPBACK, BindPolicyError, is_loopback, runtime_env

# "0": Ray runs as on macOS and Windows, a single node whose IP is the loopback address.
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init(num_cpus: int, api_host: str = LOOPBACK, api_ports: Iterable[int] = (), log_to_driver: bool = True) -> None:
    """Start the local Ray. `api_host`, `api_ports`: where Serve's proxies may serve the API
    (with `--ingress proxy`); every other listener binds loopback."""
    single_node_mode()
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
             _system_config=dict(RAY_SYSTEM_CONFIG), runtime_env=runtime_env(api_host, api_ports))
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        ray.shutdown()
        raise BindPolicyError(f"the local Ray took {node_ip} as its node IP, not the loopback address")


def connect(address: str | None, log_to_driver: bool = True) -> None:
    """Join a running cluster as a driver: `address`, else the one $RAY_ADDRESS names or this
    machine runs (Ray's "auto", the only form to which a local Ray hands its auth token).
    One whose GCS listens on loopback was started by `init`: its drivers take the same
    single-node mode, or Ray would wait for a node at this host's network address."""
    bootstrap = services.get_ray_address_from_environment(address or "auto", None)
    if bootstrap and ":" in bootstrap and is_loopback(bootstrap.rsplit(":", 1)[0]):
        single_node_mode()
    ray.init(address=address or "auto", include_dashboard=False, log_to_driver=log_to_driver)


def single_node_mode() -> None:
    # The processes Ray starts inherit the variable; this one read it when it imported Ray.
    os.environ[SINGLE_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
