"""A real local cluster behind Serve's HTTP and gRPC ingress, for tests through real
clients (the `openai` SDK, generated gRPC stubs, httpx, schemathesis).

One local Ray and Serve for the whole package (starting and stopping them costs ~16 s);
one cluster per module on it: a private redis-server, 1 prefill + 1 decode worker and the
gateway, with an API key, deleted when the module ends. `redeploy(gateway=...)` swaps the gateway's limits;
the workers keep running (their arguments do not change, so Serve keeps them);
`redeploy(engine=...)` restarts them on another checkpoint (same tokenizer), and
`redeploy(prefill_tp=..., decode_tp=...)` on that many tensor-parallel ranks per replica,
and `redeploy(colocated=True)` without a prefill tier.
"""

import dataclasses

import httpx
import pytest
import ray
from ray import serve

from cluster.config import (
    APP_NAME,
    CacheConfig,
    ClusterConfig,
    EngineConfig,
    GatewayConfig,
    RoutingConfig,
    SchedulerConfig,
    TierConfig,
    TransportConfig,
)
from cluster.launch.app import build_app, grpc_options
from cluster.launch.ports import free_port
from cluster.launch.redis_server import PrivateRedis
from cluster.launch.serve import start_local_ray

API_KEY = "sk-test-0123456789"
MODEL_NAME = "tiny-qwen2"


@dataclasses.dataclass
class LiveCluster:
    http_url: str
    grpc_target: str
    engine_config: EngineConfig
    redis: PrivateRedis
    handle: object = None

    def redeploy(
        self,
        gateway: GatewayConfig = GatewayConfig(api_keys=(API_KEY,)),
        redis_url: str | None = None,
        gateways: int = 1,
        transport: TransportConfig = TransportConfig(timeout_s=10.0),
        prefills: int = 1,
        routing: RoutingConfig = RoutingConfig(),
        decodes: int = 1,
        drain_timeout_s: float = 30.0,
        engine: EngineConfig | None = None,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        colocated: bool = False,
        otlp_endpoint: str | None = None,
        resources: dict[str, dict[str, float]] | None = None,
    ):
        """`resources`: custom Ray resources each replica of a tier ("prefill", "decode",
        "router") asks for, which place it on the nodes that declare them."""
        resources = resources or {}
        config = ClusterConfig(
            engine=engine or self.engine_config,
            prefill=TierConfig(num_replicas=prefills, num_cpus=0.5, tensor_parallel_size=prefill_tp,
                               resources=resources.get("prefill")),
            decode=TierConfig(num_replicas=decodes, num_cpus=0.5, drain_timeout_s=drain_timeout_s, tensor_parallel_size=decode_tp,
                              resources=resources.get("decode")),
            router=TierConfig(num_replicas=gateways, num_cpus=0.1, resources=resources.get("router")),
            transport=transport,
            redis_url=redis_url or self.redis.url,
            gateway=gateway,
            routing=routing,
            colocated=colocated,
            otlp_endpoint=otlp_endpoint,
        )
        self.handle = serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        return self.handle

    @staticmethod
    def gateway_config(**settings) -> GatewayConfig:
        """The module's gateway (its API key) with other settings."""
        return GatewayConfig(**{"api_keys": (API_KEY,), **settings})

    def scrape(self) -> str:
        """The gateway's /metrics text (it wants the key, like every route but /health)."""
        return httpx.get(self.http_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text


@pytest.fixture(scope="module")
def engine_config(tiny_models):
    return EngineConfig(
        model=str(tiny_models["qwen2"]),
        served_model_name=MODEL_NAME,
        dtype="float32",
        max_model_len=512,  # room for streams long enough to outlast a cancellation's way to the workers
        cache=CacheConfig(block_size=8, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),  # prompts above 32 tokens are chunked
    )


@pytest.fixture(scope="module")
def wide_model_config(engine_config, wide_model):
    """engine_config on the wide model (tests/conftest.py: wide_model)."""
    return dataclasses.replace(engine_config, model=str(wide_model))


@pytest.fixture(scope="package")
def serve_ingress():
    """Local Ray and Serve for every module here: (HTTP base URL, gRPC target)."""
    http_port, grpc_port = free_port(), free_port()
    start_local_ray(8, "auto", log_to_driver=False)  # (direct ingress where Serve ships HAProxy, as `pdserve serve`)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, grpc_options=grpc_options(grpc_port))
    try:
        yield f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def live(serve_ingress, engine_config):
    with PrivateRedis() as redis:
        cluster = LiveCluster(*serve_ingress, engine_config, redis)
        cluster.redeploy()
        try:
            yield cluster
        finally:
            serve.delete(APP_NAME)  # every replica stopped: the next module starts from none


@pytest.fixture
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}
