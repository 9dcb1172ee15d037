"""The cluster of tests/e2e on several Ray nodes of this machine (cluster/host/local_nodes.py):
the head (Serve's controller and proxy, the gateway), one prefill node and two decode
nodes, each tier placed by the custom resources deploy/cluster.yaml's node types declare.
Each prefill or decode replica takes a node of its tier to itself, so the two decode
replicas run on different nodes and a dead node's replacement waits for a new one, as on
a real cluster (cluster/host/local_nodes.py: placement).

Its own package: one process holds one Ray, and tests/e2e's is a single-node one."""

import dataclasses

import pytest
from ray import serve

from cluster.config import APP_NAME, CacheConfig, EngineConfig, RoutingConfig, SchedulerConfig
from cluster.host.local_nodes import LocalNodes, placement
from cluster.launch.ports import free_port
from cluster.launch.redis_server import PrivateRedis
from cluster.launch.serve import start_local_nodes
from tests.e2e.conftest import MODEL_NAME, LiveCluster


@dataclasses.dataclass
class NodesCluster(LiveCluster):
    nodes: LocalNodes | None = None

    def redeploy(self, **kwargs):
        # Every prompt is prefilled on the prefill node (none computed where it decodes).
        return super().redeploy(**{"resources": placement(), "decodes": 2, "routing": RoutingConfig(max_local_prefill_tokens=0),
                                   **kwargs})


@pytest.fixture(scope="module")
def nodes():
    local = start_local_nodes(2, "auto", log_to_driver=False)
    try:
        for tier in ("prefill", "decode", "decode"):
            local.add_tier_node(tier)
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
