"""Several Ray nodes on this machine: a head and worker nodes, each with its own raylet,
object store, workers and resources, as `ray up` gives on separate machines. For the
multi-node tests and `pdserve bench chaos --nodes` (tiers on nodes of their own; a whole
node killed under load).

Built on Ray's own test cluster (ray.cluster_utils.Cluster). Every node takes the loopback
address as its node IP, in single-node mode as cluster/host/local_ray.py starts a local
Ray, so nothing listens beyond loopback. Nodes are told apart by their Ray node id, never
by IP: they all share it. Ray moves objects between two such nodes over TCP, and so does
the KV transport (cluster/kv/transport/torch_dist.py: shared memory within one Ray node
only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import ray
from ray.cluster_utils import Cluster

from cluster.config import RAY_SYSTEM_CONFIG
from cluster.host.bind_policy import LOOPBACK, runtime_env
from cluster.host.local_ray import single_node_mode

OBJECT_STORE_BYTES = 100 << 20  # per node: Ray's minimum is 75 MiB; pdserve's payloads do not go through it


@dataclass
class LocalNode:
    name: str
    resources: dict[str, float]
    num_cpus: int
    node: object = field(repr=False)  # ray._private.node.Node

    @property
    def node_id(self) -> str:
        return self.node.node_id


class LocalNodes:
    """A head node (this process's driver joins it) and worker nodes added by `add`.
    `kill` stops a worker node at once, as a machine that fails: its raylet and every
    process on it. Ray's and Serve's settings in this process's environment now (e.g.
    cluster/launch/ingress.settings) reach every node, those added later too."""

    def __init__(self, head_cpus: int, head_resources: Mapping[str, float] | None = None, log_to_driver: bool = False):
        single_node_mode()
        self._env = {key: value for key, value in os.environ.items() if key.startswith("RAY_")}
        self.nodes: dict[str, LocalNode] = {}
        self._cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=self._node_args(
            head_cpus, head_resources, include_dashboard=False, _system_config=dict(RAY_SYSTEM_CONFIG),
        ))
        self.head = LocalNode("head", dict(head_resources or {}), head_cpus, self._cluster.head_node)
        ray.init(address=self._cluster.address, include_dashboard=False, log_to_driver=log_to_driver,
                 runtime_env=runtime_env(LOOPBACK, ()))

    def _node_args(self, num_cpus: int, resources: Mapping[str, float] | None, **more) -> dict:
        return dict(num_cpus=num_cpus, resources=dict(resources or {}), node_ip_address=LOOPBACK,
                    object_store_memory=OBJECT_STORE_BYTES, env_vars=dict(self._env), **more)

    def add(self, name: str, num_cpus: int, resources: Mapping[str, float]) -> LocalNode:
        """Start a worker node; returns once Ray counts it."""
        if name in self.nodes:
            raise ValueError(f"a node named {name!r} exists already")
        node = LocalNode(name, dict(resources), num_cpus, self._cluster.add_node(**self._node_args(num_cpus, resources)))
        self.nodes[name] = node
        return node

    def by_id(self, node_id: str) -> LocalNode:
        for node in self.nodes.values():
            if node.node_id == node_id:
                return node
        raise KeyError(f"no worker node with id {node_id}")

    def kill(self, name: str) -> None:
        """SIGKILL the node's raylet and agents; its workers die with their raylet."""
        node = self.nodes.pop(name)
        self._cluster.remove_node(node.node, allow_graceful=False)

    def shutdown(self) -> None:
        ray.shutdown()
        self._cluster.shutdown()
        self.nodes.clear()

    def __enter__(self) -> LocalNodes:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
