"""Serve's request router for the worker deployments: it places each request where the
gateway's RouteHint says (cluster/serving/routing.py), among the replicas Serve reports running,
and publishes that set of replicas (cluster/serving/routing.py: live_replicas) so that placement
counts a new replica as soon as Serve routes to it and stops choosing one being removed.

    hint.replica       that replica first (the KV-aware choice); the others if it is full or gone
    hint.affinity_key  rendezvous hashing: the replica with the highest H(key, replica id),
                       so a prefix sticks to one replica while the set of replicas is stable
                       and only 1/n of prefixes move when a replica comes or goes
    round_robin        the next replica in id order
    otherwise          Serve's power of two choices (also for calls without a hint)
"""

from __future__ import annotations

import hashlib
import itertools

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from cluster.serving.routing import RouteHint, set_live_replicas

IMPORT_PATH = "router.replica_router:HintedRequestRouter"


def rendezvous_order(key: bytes, replicas: list[str]) -> list[str]:
    """Replica ids by descending H(key, id): the first is where `key` goes."""
    return sorted(replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest(), reverse=True)


class HintedRequestRouter(PowerOfTwoChoicesRequestRouter):
    _turns = itertools.count()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish_live_replicas()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # drops it without an update_replicas call
        self._publish_live_replicas()

    def _publish_live_replicas(self) -> None:
        set_live_replicas(self._deployment_id.name, frozenset(r.unique_id for r in self.curr_replicas))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hint = _hint_of(pending_request)
        if hint is None or not candidate_replicas:
            return await super().choose_replicas(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if hint.replica is not None:
            first = by_id.get(hint.replica)
        elif hint.affinity_key is not None:
            first = by_id[rendezvous_order(hint.affinity_key, list(by_id))[0]]
        elif hint.policy == "round_robin":
            ids = sorted(by_id)
            first = by_id[ids[next(self._turns) % len(ids)]]
        else:
            return await super().choose_replicas(candidate_replicas, pending_request)
        if first is None:  # the chosen replica is gone: any other
            return [candidate_replicas]
        return [[first], [r for r in candidate_replicas if r is not first]]


def _hint_of(pending_request: PendingRequest | None) -> RouteHint | None:
    """The first argument's route (a request message), or the first argument itself (stats)."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, RouteHint) else getattr(first, "route", None)
