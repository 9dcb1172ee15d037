"""Builds the Ray Serve application from a ClusterConfig.

    Gateway (ingress: HTTP + gRPC) --> DecodeWorker --(prefill call)--> PrefillWorker
                                            ^------ KV blocks over torch.distributed ----'

Colocated mode drops the prefill tier: each DecodeWorker runs both phases.
`app_builder` is the entry point of `serve deploy deploy/serve.yaml`; its `args` are a
ClusterConfig in plain data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import ClusterConfig, TierConfig, from_dict
from cluster.serving import tracing
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from router.gateway import Gateway
from router.replica_router import IMPORT_PATH as HINTED_REQUEST_ROUTER


def tier_options(tier: TierConfig) -> dict:
    actor_options = {"num_cpus": tier.num_cpus, "num_gpus": tier.num_gpus}
    if tier.resources:
        actor_options["resources"] = dict(tier.resources)
    if tier.env:
        actor_options["runtime_env"] = {"env_vars": dict(tier.env)}
    scaling = {"autoscaling_config": tier.autoscaling} if tier.autoscaling else {"num_replicas": tier.num_replicas}
    placement = {}
    if tier.tensor_parallel_size > 1:
        # One bundle per rank: the replica actor (rank 0) takes bundle 0, rank r bundle r
        # (cluster/engine/tp_ranks.py); Serve reserves the group with the replica.
        bundle = {k: v for k, v in (("CPU", tier.num_cpus), ("GPU", tier.num_gpus)) if v}
        bundle.update(tier.resources or {})
        placement = {
            "placement_group_bundles": [dict(bundle) for _ in range(tier.tensor_parallel_size)],
            "placement_group_strategy": tier.placement_strategy,
        }
    return {
        **placement,
        "ray_actor_options": actor_options,
        "max_ongoing_requests": tier.max_ongoing_requests,
        "graceful_shutdown_timeout_s": tier.drain_timeout_s,  # Serve waits this long for running requests
        "graceful_shutdown_wait_loop_s": 0.5,
        **scaling,
    }


# The proxies' gRPC services: ours and the standard health service, both routed to the Gateway.
GRPC_SERVICER_FUNCTIONS = (
    "router.grpc_service.add_generation_servicer_to_server",  # the generated one's, malformed bytes a 400
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)


def grpc_options(port: int) -> dict:
    return {"port": port, "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS)}


def code_version(*args) -> str:
    """A deployment's version: what its replicas run (package version, arguments).

    Serve restarts replicas whenever the version changes, and invents a random one when
    none is given; a stable version lets a redeploy that only changes scaling (replica
    counts, autoscaling) add or remove replicas without restarting the others.
    """
    digest = hashlib.sha256(repr(args).encode()).hexdigest()[:16]
    return f"{importlib.metadata.version('pdserve')}-{digest}"


def build_app(config: ClusterConfig) -> Application:
    def deployment(cls, tier: TierConfig, *args):
        if config.otlp_endpoint:  # every replica's process exports its spans there
            tier = dataclasses.replace(tier, env={**(tier.env or {}), tracing.ENDPOINT_ENV: config.otlp_endpoint})
        d = serve.deployment(cls, name=cls.__name__, **tier_options(tier))
        if cls is not Gateway:  # workers are placed by the gateway's route hints
            d = d.options(request_router_config=RequestRouterConfig(request_router_class=HINTED_REQUEST_ROUTER))
        # Public options refuse `version` since Serve 2.x; `_internal` is the way Serve's own
        # config deploys pass one (Ray is pinned, see pyproject.toml).
        return d.options(version=code_version(cls.__name__, *args), _internal=True)

    # The gateway's placement weighs prompt work on a decode worker at the decode tier's step budget.
    gateway_engine = dataclasses.replace(config.engine, scheduler=config.scheduler_for("decode"))
    gateway_args = (gateway_engine, config.gateway, config.routing, config.redis_url)
    # The gateway config's repr leaves out the API keys; their digest still versions it.
    gateway_version = (*gateway_args, hashlib.sha256("\n".join(config.gateway.api_keys).encode()).hexdigest())
    if config.colocated:
        decode_args = (config.engine_for(config.decode, "decode"), config.transport)
        decode = deployment(DecodeWorker, config.decode, *decode_args, config.redis_url).bind(
            *decode_args, redis_url=config.redis_url
        )
        return deployment(Gateway, config.router, *gateway_version, "colocated").bind(*gateway_args, decode)
    prefill_args = (config.engine_for(config.prefill, "prefill"), config.transport, config.redis_url)
    prefill = deployment(PrefillWorker, config.prefill, *prefill_args).bind(*prefill_args)
    decode_args = (config.engine_for(config.decode, "decode"), config.transport)
    decode = deployment(DecodeWorker, config.decode, *decode_args, config.redis_url, "disaggregated").bind(
        *decode_args, prefill, redis_url=config.redis_url
    )
    return deployment(Gateway, config.router, *gateway_version, "disaggregated").bind(*gateway_args, decode, prefill)


def app_builder(args: dict) -> Application:
    return build_app(from_dict(ClusterConfig, args))
