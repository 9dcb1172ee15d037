"""Placement: which (prefill, decode) workers serve a request, by the configured policy.

    kv_aware      look the prompt's block hashes up in the prefix index (one round trip)
                  and pick, per tier, the worker of least cost, in tokens of work:
                    prefill: uncached prompt tokens + its queued tokens + what this
                             gateway routed there that has not started decoding yet
                    decode:  transfer_weight x prompt tokens it lacks (the KV to move)
                             + running_weight x its running requests (+ ours in flight),
                             and effectively never a worker whose KV cache is > 95% full
                  The cost is a sum of a prefill and a decode term, so the best pair is
                  the best of each tier. Ties go by rendezvous order of the prefix. When
                  the index is slow (> index_timeout_s) or down, or lists no worker of a
                  tier, the request falls back to prefix_hash (counted, never failed).
                  Colocated, the decode worker computes the prompt: its cost is the
                  prefill one plus the running term.
    prefix_hash   rendezvous hashing of the first PREFIX_HASH_BLOCKS blocks: sticky without an index
    round_robin   each tier in turn
    power_of_two  Ray Serve's default: the shorter queue of two random replicas

The hashes are `cluster/kv/hashing.py`'s, over the blocks the engine could reuse (all
full blocks but one token, as KVCacheManager.cached_prefix counts them).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field

from cluster.config import EngineConfig, RoutingConfig
from cluster.engine.kv_cache_manager import num_reusable_blocks
from cluster.kv.hashing import BlockHash, hash_prefix_blocks
from cluster.kv.prefix_index import PrefixIndex, WorkerView
from cluster.routing import RouteHint, replica_of
from router.replica_router import rendezvous_order

PREFIX_HASH_BLOCKS = 4
FULL_KV_USAGE = 0.95
FULL_PENALTY = 1e9


@dataclass
class Placement:
    """Where a request goes, what the index promised there, and what it holds while running."""

    decode: RouteHint
    prefill: RouteHint
    predicted_hits: dict[tuple[str, str], int] = field(default_factory=dict)  # (tier, worker) -> tokens
    pending_tokens: dict[str, int] = field(default_factory=dict)  # prefill worker -> tokens to prefill
    decode_worker: str | None = None
    fallback: str | None = None  # why kv_aware was not used


class Placer:
    def __init__(self, engine: EngineConfig, routing: RoutingConfig, redis_url: str | None, colocated: bool, metrics):
        self.config = routing
        self.block_size = engine.cache.block_size
        self.model_id = engine.model_id
        self.colocated = colocated
        self.metrics = metrics
        self.index = None
        if routing.policy == "kv_aware" and redis_url:
            self.index = PrefixIndex(redis_url, self.model_id, self.block_size, timeout_s=routing.index_timeout_s)
        # This gateway's own work on each worker since the index last saw it.
        self._pending_prefill_tokens: Counter[str] = Counter()
        self._decoding: Counter[str] = Counter()

    def block_hashes(self, prompt_ids: list[int]) -> list[BlockHash]:
        reusable = num_reusable_blocks(len(prompt_ids), self.block_size) * self.block_size
        return hash_prefix_blocks(prompt_ids[:reusable], self.block_size, self.model_id)

    async def place(self, prompt_ids: list[int]) -> Placement:
        hashes = self.block_hashes(prompt_ids)
        affinity = _affinity_key(hashes, prompt_ids)
        policy = self.config.policy
        if policy == "kv_aware":
            placement, reason = await self._kv_aware(prompt_ids, hashes, affinity)
            if placement is not None:
                return placement
            self.metrics.route_fallbacks.labels(reason).inc()
            placement = _sticky(affinity)
            placement.fallback = reason
            return placement
        if policy == "prefix_hash":
            return _sticky(affinity)
        hint = RouteHint(policy=policy)
        return Placement(decode=hint, prefill=hint)

    async def _kv_aware(self, prompt_ids, hashes, affinity) -> tuple[Placement | None, str]:
        if self.index is None:
            return None, "no_index"
        start = time.perf_counter()
        try:
            views = await self.index.lookup(hashes)
        except TimeoutError:
            return None, "index_timeout"
        except Exception:  # noqa: BLE001 - Redis down or refusing: degrade, never fail
            return None, "index_unavailable"
        finally:
            self.metrics.index_lookup.observe(time.perf_counter() - start)
        decodes = [v for v in views if v.tier == "decode"]
        prefills = [v for v in views if v.tier == "prefill"]
        if not decodes or (not self.colocated and not prefills):
            return None, "index_empty"
        n = len(prompt_ids)
        order = {w: rank for rank, w in enumerate(rendezvous_order(affinity, [v.worker_id for v in views]))}

        def uncached(v: WorkerView) -> int:
            return n - min(v.hit_blocks, len(hashes)) * self.block_size

        def prefill_cost(v: WorkerView) -> tuple[float, int]:
            return uncached(v) + v.queued_tokens + self._pending_prefill_tokens[v.worker_id], order[v.worker_id]

        def decode_cost(v: WorkerView) -> tuple[float, int]:
            full = FULL_PENALTY if v.kv_usage > FULL_KV_USAGE else 0.0
            running = self.config.running_weight * (v.running + self._decoding[v.worker_id])
            work = prefill_cost(v)[0] if self.colocated else self.config.transfer_weight * uncached(v)
            return work + running + full, order[v.worker_id]

        d = min(decodes, key=decode_cost)
        placement = Placement(decode=RouteHint(replica=replica_of(d.worker_id)), prefill=RouteHint(), decode_worker=d.worker_id)
        placement.predicted_hits[("decode", d.worker_id)] = n - uncached(d)
        if self.colocated:
            placement.pending_tokens[d.worker_id] = uncached(d)
        else:
            p = min(prefills, key=prefill_cost)
            placement.prefill = RouteHint(replica=replica_of(p.worker_id))
            placement.predicted_hits[("prefill", p.worker_id)] = n - uncached(p)
            placement.pending_tokens[p.worker_id] = uncached(p)
        return placement, ""

    # ---- this gateway's in-flight work, so a burst does not all land on one worker ----

    def started(self, placement: Placement) -> None:
        for (tier, worker), tokens in placement.predicted_hits.items():
            self.metrics.predicted_hits.labels(tier, worker).inc(tokens)
        self._pending_prefill_tokens.update(placement.pending_tokens)
        if placement.decode_worker:
            self._decoding[placement.decode_worker] += 1

    def first_token(self, placement: Placement) -> None:
        self._pending_prefill_tokens.subtract(placement.pending_tokens)
        placement.pending_tokens = {}
        _drop_zeros(self._pending_prefill_tokens)

    def finished(self, placement: Placement) -> None:
        self.first_token(placement)
        if placement.decode_worker:
            self._decoding[placement.decode_worker] -= 1
            placement.decode_worker = None
            _drop_zeros(self._decoding)


def _affinity_key(hashes: list[BlockHash], prompt_ids: list[int]) -> bytes:
    if hashes:
        return hashes[min(len(hashes), PREFIX_HASH_BLOCKS) - 1]  # a chain hash names its whole prefix
    return hashlib.blake2b(repr(prompt_ids).encode(), digest_size=16).digest()


def _sticky(affinity: bytes) -> Placement:
    hint = RouteHint(affinity_key=affinity)
    return Placement(decode=hint, prefill=hint)


def _drop_zeros(counter: Counter) -> None:
    for key in [k for k, v in counter.items() if v <= 0]:
        del counter[key]
