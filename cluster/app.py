"""Builds the Ray Serve application from a ClusterConfig.

    Router (ingress) --> DecodeWorker --(prefill call)--> PrefillWorker
                              ^------ KV blocks over torch.distributed ----'

Colocated mode drops the prefill tier: each DecodeWorker runs both phases.
`app_builder` is the entry point of `serve deploy deploy/serve.yaml`; its `args` are a
ClusterConfig in plain data.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from cluster.config import ClusterConfig, TierConfig, from_dict
from decode_worker.worker import DecodeWorker
from prefill_worker.worker import PrefillWorker
from router.router import Router


def tier_options(tier: TierConfig) -> dict:
    actor_options = {"num_cpus": tier.num_cpus, "num_gpus": tier.num_gpus}
    if tier.resources:
        actor_options["resources"] = dict(tier.resources)
    scaling = {"autoscaling_config": tier.autoscaling} if tier.autoscaling else {"num_replicas": tier.num_replicas}
    return {"ray_actor_options": actor_options, **scaling}


def build_app(config: ClusterConfig) -> Application:
    decode_deployment = serve.deployment(DecodeWorker, name="DecodeWorker", **tier_options(config.decode))
    router_deployment = serve.deployment(Router, name="Router", **tier_options(config.router))
    if config.colocated:
        decode = decode_deployment.bind(config)
        return router_deployment.bind(config, decode)
    prefill = serve.deployment(PrefillWorker, name="PrefillWorker", **tier_options(config.prefill)).bind(config)
    decode = decode_deployment.bind(config, prefill)
    return router_deployment.bind(config, decode, prefill)


def app_builder(args: dict) -> Application:
    return build_app(from_dict(ClusterConfig, args))
