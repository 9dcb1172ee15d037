"""The cluster of tests/e2e on several Ray nodes of this machine (cluster/host/local_nodes.py):
the head (Serve's controller and proxy, the gateway), one prefill node and two decode
nodes, each tier placed by the custom resources deploy/cluster.yaml's node types declare.
Each decode replica asks for a whole node's `decode_node`, so the two run on different
nodes and a dead node's replacement waits for a new one, as on a real cluster.

Its own package: one process holds one Ray, and tests/e2e's is a single-node one."""

import dataclasses

import pytest
from ray import serve

from cluster.config import APP_NAME, CacheConfig, EngineConfig, RoutingConfig, SchedulerConfig
from cluster.host.local_nodes import LocalNodes
from cluster.launch import ingress
from cluster.launch.ports import free_port
from cluster.launch.redis_server import PrivateRedis
from tests.e2e.conftest import MODEL_NAME, LiveCluster

PLACEMENT = {"router": {"gateway_node": 0.01}, "prefill": {"prefill_node": 0.01}, "decode": {"decode_node": 1}}


@dataclasses.dataclass
class NodesCluster(LiveCluster):
    nodes: LocalNodes | None = None

    def redeploy(self, **kwargs):
        # Every prompt is prefilled on the prefill node (none computed where it decodes).
        return super().redeploy(**{"resources": PLACEMENT, "decodes": 2, "routing": RoutingConfig(max_local_prefill_tokens=0),
                                   **kwargs})


@pytest.fixture(scope="module")
def nodes():
    with ingress.settings("auto"):
        local = LocalNodes(head_cpus=2, head_resources={"gateway_node": 1})
    try:
        local.add("prefill-1", 1, {"prefill_node": 1})
        for name in ("decode-1", "decode-2"):
            local.add(name, 1, {"decode_node": 1})
        yield local
    finally:
        local.shutdown()


@pytest.fixture(scope="module")
def engine_config(wide_model):
    return EngineConfig(
        model=str(wide_model), served_model_name=MODEL_NAME, dtype="float32", max_model_len=512,
        cache=CacheConfig(block_size=8, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),  # prompts above 32 tokens are chunked: KV in parts
    )


@pytest.fixture(scope="module")
def live(nodes, engine_config):
    http_port = free_port()
    # One proxy, on the head: every node here shares the loopback address, so a proxy per
    # node (Serve's default) would contend for one port.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
    try:
        with PrivateRedis() as redis:
            cluster = NodesCluster(f"http://127.0.0.1:{http_port}", "", engine_config, redis, nodes=nodes)
            cluster.redeploy()
            yield cluster
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
