"""Several Ray nodes on this machine: a head and worker nodes, each with its own raylet,
object store, workers and resources, as `ray up` gives on separate machines. For the
multi-node tests and `pdserve bench chaos --nodes` (tiers on nodes of their own; a whole
node killed under load).

Built on Ray's own test cluster (ray.cluster_utils.Cluster). Worker nodes are started by
one long-lived thread, whichever thread asks: Ray ties a node's processes to the thread
that started them (PR_SET_PDEATHSIG), and a node the chaos benchmark's fault thread adds
must outlive that thread. Every node takes the loopback address as its node IP, in
single-node mode as cluster/host/local_ray.py starts a local Ray, so nothing listens
beyond loopback. Nodes are told apart by their Ray node id, never by IP: they all share
it. Ray moves objects between two such nodes over TCP, and so does the KV transport
(cluster/kv/transport/torch_dist.py: shared memory within one Ray node only).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
from ray._private import node as ray_node
from ray._private.parameter import RayParams
from ray.cluster_utils import Cluster

from cluster.config import RAY_SYSTEM_CONFIG
from cluster.host.bind_policy import LOOPBACK, runtime_env
from cluster.host.local_ray import single_node_mode

OBJECT_STORE_BYTES = 100 << 20  # per node: Ray's minimum is 75 MiB; pdserve's payloads do not go through it
GATEWAY_RESOURCE = "gateway_node"  # the head's: the gateways run beside Serve's controller and proxy


def tier_resource(tier: str) -> str:
    """The custom resource a tier's nodes declare (deploy/cluster.yaml's node types too)."""
    return f"{tier}_node"


def placement() -> dict[str, dict[str, float]]:
    """Per tier, the resources each replica asks for: the gateways on the head, each
    prefill or decode replica a node of its own tier to itself (`add_tier_node`)."""
    return {"router": {GATEWAY_RESOURCE: 0.01}, **{tier: {tier_resource(tier): 1} for tier in ("prefill", "decode")}}


@dataclass
class LocalNode:
    name: str
    node: object = field(repr=False)  # ray._private.node.Node

    @property
    def node_id(self) -> str:
        return self.node.node_id


class LocalNodes:
    """A head node (this process's driver joins it) and worker nodes added by `add`.
    `kill` stops a worker node at once, as a machine that fails: its raylet and every
    process on it. Ray's and Serve's settings in this process's environment now (e.g.
    cluster/launch/ingress.settings) reach every node, those added later too."""

    def __init__(self, head_cpus: int, log_to_driver: bool = False):
        single_node_mode()
        self._env = {key: value for key, value in os.environ.items() if key.startswith("RAY_")}
        self.nodes: dict[str, LocalNode] = {}
        self._added = 0
        head_resources = {GATEWAY_RESOURCE: 1}
        self._cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=self._node_args(
            head_cpus, head_resources, include_dashboard=False, _system_config=dict(RAY_SYSTEM_CONFIG),
        ))
        self.head = LocalNode("head", self._cluster.head_node)
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="ray-nodes")
        atexit.register(self.shutdown)
        ray.init(address=self._cluster.address, include_dashboard=False, log_to_driver=log_to_driver,
                 runtime_env=runtime_env(LOOPBACK, ()))

    def _node_args(self, num_cpus: int, resources: Mapping[str, float] | None, **more) -> dict:
        return dict(num_cpus=num_cpus, resources=dict(resources or {}), node_ip_address=LOOPBACK,
                    object_store_memory=OBJECT_STORE_BYTES, env_vars=dict(self._env), **more)

    def add(self, name: str, num_cpus: int, resources: Mapping[str, float]) -> LocalNode:
        """Start a worker node; returns once Ray counts it. From any thread."""
        if name in self.nodes:
            raise ValueError(f"a node named {name!r} exists already")
        self._added += 1
        started = self._starter.submit(self._start_worker_node, self._node_args(num_cpus, resources)).result()
        node = self.nodes[name] = LocalNode(name, started)
        return node

    def _start_worker_node(self, node_args: dict):
        """Cluster.add_node's worker-node path, without its exit hooks (a signal handler can
        be set on the main thread only; shutdown() and the atexit hook stop the nodes)."""
        params = RayParams(**node_args)
        params.update_if_absent(num_gpus=0, min_worker_port=0, max_worker_port=0, gcs_address=self._cluster.gcs_address,
                                redis_address=self._cluster.redis_address, include_log_monitor=False, node_manager_port=0)
        params.dashboard_agent_listen_port = None  # a free one: the head's agent has the default
        node = ray_node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=True)
        self._cluster.worker_nodes.add(node)
        self._cluster._wait_for_node(node)
        return node

    def add_tier_node(self, tier: str, num_cpus: int = 1) -> LocalNode:
        """A node for one replica of `tier` (`placement`), named after the tier: decode-3."""
        return self.add(f"{tier}-{self._added + 1}", num_cpus, {tier_resource(tier): 1})

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
        """Stop every node (again: nothing)."""
        atexit.unregister(self.shutdown)
        ray.shutdown()
        self._cluster.shutdown()
        self._starter.shutdown()
        self.nodes.clear()
