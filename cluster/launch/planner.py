"""`pdserve serve --planner slo`: the application deployed from a Serve config whose
application-level autoscaling policy is the SLO planner (cluster/planner/policy.py).

Serve takes an application-level policy only from a config (`autoscaling_policy`), not
from `serve.run`: so with the planner on, the application is deployed as
`serve deploy deploy/serve.yaml` deploys it, by `cluster.launch.app:app_builder` with the
ClusterConfig as its args. Both tiers autoscale within the planner's bounds; Serve's own
delays are 0 (the planner confirms a change itself before making it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from ray import serve
from ray.serve.schema import ServeDeploySchema

from cluster.config import APP_NAME, ClusterConfig, TierConfig
from cluster.planner.profile import Profile
from cluster.serving.routing import TIER_DEPLOYMENTS

POLICY = "cluster.planner.policy:SloPlanner"
METRICS_INTERVAL_S = 2.0  # how often replicas report (record_autoscaling_stats)
# Serve averages each replica's reports over this window: about one report, since each already
# covers the replica's own window (cluster/planner/load.py), and a second average would lag.
LOOK_BACK_S = 1.5 * METRICS_INTERVAL_S  # (Serve wants it longer than the interval)
HORIZON_S = 10.0  # a decision acts after about a replica's start: the planner sizes for the load then
DEPLOY_TIMEOUT_S = 900.0


def units(tier: TierConfig) -> float:
    """What one replica of `tier` costs of the planner's budget: its GPUs, or on a CPU
    cluster its cores, over all its ranks."""
    return (tier.num_gpus or tier.num_cpus) * tier.tensor_parallel_size


def budget(config: ClusterConfig, local: bool) -> float:
    """The planner's budget: as given; else this machine's cores for a local CPU cluster,
    else every tier at its max (the bounds alone limit it)."""
    planner = config.planner
    if planner.budget is not None:
        return planner.budget
    if local and not config.prefill.num_gpus and not config.decode.num_gpus:
        return float(os.cpu_count() or 1)
    return planner.max_prefill * units(config.prefill) + planner.max_decode * units(config.decode)


def planned(config: ClusterConfig) -> ClusterConfig:
    """`config` with both tiers autoscaled within the planner's bounds, starting at their
    num_replicas (within the bounds)."""
    p = config.planner
    if p.mode == "off":
        return config
    if config.gateway.api_keys:
        raise ValueError("with --planner slo the API keys must come from --api-key-file: the Serve config that "
                         "deploys the application would hold them")
    if p.profile:
        Profile.load(p.profile)  # a bad file: one line now, not a policy that fails in Serve's controller

    def autoscaled(tier: TierConfig, low: int, high: int) -> TierConfig:
        return dataclasses.replace(tier, autoscaling={
            "min_replicas": low, "max_replicas": high, "initial_replicas": min(max(tier.num_replicas, low), high),
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "metrics_interval_s": METRICS_INTERVAL_S, "look_back_period_s": LOOK_BACK_S,
        })

    return dataclasses.replace(config, prefill=autoscaled(config.prefill, p.min_prefill, p.max_prefill),
                               decode=autoscaled(config.decode, p.min_decode, p.max_decode))


def policy(config: ClusterConfig, local: bool) -> dict:
    """The application's `autoscaling_policy`: the planner and its arguments (JSON)."""
    p = config.planner
    return {"policy_function": POLICY, "policy_kwargs": {
        "ttft_ms": p.ttft_ms, "itl_ms": p.itl_ms, "tiers": dict(TIER_DEPLOYMENTS),
        "bounds": {"min_prefill": p.min_prefill, "max_prefill": p.max_prefill, "min_decode": p.min_decode,
                   "max_decode": p.max_decode, "budget": budget(config, local),
                   "prefill_units": units(config.prefill), "decode_units": units(config.decode)},
        "step_slowdown": config.decode_step_slowdown, "interval_s": p.interval_s, "confirm": p.confirm, "downscale_s": p.downscale_s,
        "horizon_s": HORIZON_S, "redis_url": config.redis_url, "app_name": APP_NAME,
        "seed_costs": Profile.load(p.profile).costs() if p.profile else None,
    }}


def deploy(config: ClusterConfig, local: bool) -> None:
    """Deploy the application with the planner (Serve already started), and wait until
    it runs; a deployment Serve gave up on raises RuntimeError with Serve's message."""
    schema = ServeDeploySchema(applications=[{
        "name": APP_NAME, "route_prefix": "/", "import_path": "cluster.launch.app:app_builder",
        # Plain JSON, as a YAML config's args are (a path object becomes its text).
        "args": json.loads(json.dumps(dataclasses.asdict(config), default=str)), "autoscaling_policy": policy(config, local),
    }])
    serve.context._get_global_client().deploy_apps(schema)
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.status == "RUNNING":
            return
        if app is not None and app.status == "DEPLOY_FAILED":
            raise RuntimeError(f"Serve could not deploy {APP_NAME}: {app.message}")
        time.sleep(0.5)
    raise RuntimeError(f"{APP_NAME} was not running after {DEPLOY_TIMEOUT_S:g} s")
