"""Where a request should run: the hint the gateway attaches to a request and Serve's
request router (router/replica_router.py) reads, and each worker's identity.

A worker's id is `<tier>-<replica>`, where `replica` is Serve's unique id of the
replica that runs it: the prefix index, stats and metrics name workers by it, and the
request router finds the replica by it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from ray import serve


@dataclass(frozen=True)
class RouteHint:
    """At most one of `replica` (this replica, if running: a KV-aware choice) and
    `affinity_key` (rendezvous hashing over the running replicas) is set; otherwise
    `policy` (round_robin or power_of_two) decides."""

    replica: str | None = None
    affinity_key: bytes | None = None
    policy: str = "power_of_two"


def replica_unique_id() -> str:
    """Serve's id of the replica running this code (a random one outside Serve)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a Serve replica (tests, scripts)
        return uuid.uuid4().hex[:8]


def worker_id(tier: str, replica: str) -> str:
    return f"{tier}-{replica}"


def replica_of(worker: str) -> str:
    return worker.split("-", 1)[1]


# ---- the replicas Serve routes to, as this process's request routers see them ---------

# Deployment name of each worker tier (cluster/launch/app.py names deployments after their class).
TIER_DEPLOYMENTS = {"prefill": "PrefillWorker", "decode": "DecodeWorker"}

# deployment name -> ids of its replicas that Serve routes to now. Written by the request
# routers (router/replica_router.py) on the router's own thread whenever Serve's replica
# set changes; read by placement. Each value is replaced whole (a frozenset), never
# mutated, so readers on other threads see one set or the next, never half of one. It
# lives here, not beside the request router: Serve pickles that class by value, so its
# module's globals would be copies in the router.
_live_replicas: dict[str, frozenset[str]] = {}


def set_live_replicas(deployment: str, replicas: frozenset[str]) -> None:
    _live_replicas[deployment] = replicas


def live_replicas(deployment: str) -> frozenset[str] | None:
    """None until this process's request router for `deployment` has heard from Serve."""
    return _live_replicas.get(deployment)
