"""Placement: which (prefill, decode) workers serve a request, by the configured policy.

    kv_aware      look the prompt's block hashes up in the prefix index (one round trip)
                  and pick, per tier, the worker of least cost, in tokens of work:
                    prefill: uncached prompt tokens + its queued tokens
                    decode:  transfer_weight x prompt tokens it lacks (the KV to move)
                             + running_weight x its requests,
                             and effectively never a worker whose KV cache is > 95% full
                  The cost is a sum of a prefill and a decode term, so the best pair is
                  the best of each tier. Ties go by rendezvous order of the prefix. When
                  the index is slow (> index_timeout_s) or down, or lists no worker of a
                  tier, the request falls back to prefix_hash (counted, never failed).
                  Colocated, the decode worker computes the prompt: its cost is the
                  prefill one plus the running term.
                  Conditional disaggregation: the chosen decode worker computes a short
                  prompt (routing.max_local_prefill_tokens) itself when it would finish
                  it before the chosen prefill worker even starts it (computes_locally),
                  beside running requests only once the prefill tier is saturated
                  (routing.saturated_prefill_queue_tokens queued): a prefill tier that
                  falls behind gets help, one that keeps up leaves the decodes their ITL,
                  and long prompts never stall the decodes.
    prefix_hash   rendezvous hashing of the first PREFIX_HASH_BLOCKS blocks: sticky without an index
    round_robin   each tier in turn
    power_of_two  Ray Serve's default: the shorter queue of two random replicas

Candidates are the replicas Serve routes to now (cluster/serving/routing.py: live_replicas), not
only those the index lists: a replica that has just started counts at once, with an
empty cache and no load, and one that Serve is removing takes no new work (and its index
entries are dropped as soon as this gateway sees it go).

A worker's load is its requests queued and running, and its queued prompt tokens: the
index's figures (every gateway's work, as of the worker's last publish) or this gateway's
own count of what it sent there and is not done, whichever is larger, so a burst from
this gateway counts before the index sees it, without counting it twice. A worker that
computes prompts has its cache read the same way: the blocks the index lists there, or
those of the prompts this gateway sent there to compute and that have no first token yet,
whichever covers more of the prompt. So a burst of one new prefix goes where its first
request computes it, and the engine there computes it once (cluster/engine/scheduler.py),
instead of every replica computing it at the same time.

Load beats affinity (kv_aware and prefix_hash): when the worker that affinity picked
carries more than `load_margin` requests over the least-loaded worker of its tier, the
least-loaded one gets the request instead (pdserve_route_load_overrides_total{tier}),
unless more prompt tokens queue there than at the one affinity picked: fewer requests
behind a long prompt are no shorter a wait (a burst of short hot-prefix prompts must
not push one behind a cold 500-token prompt elsewhere). A hot prefix therefore spreads
once its worker is busy, and a replica added under load takes new work at once.

The hashes are `cluster/kv/hashing.py`'s, over the blocks the engine could reuse (all
full blocks but one token, as KVCacheManager.cached_prefix counts them).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.config import EngineConfig, RoutingConfig
from cluster.engine.kv_cache_manager import num_reusable_blocks
from cluster.kv.hashing import BlockHash, hash_prefix_blocks
from cluster.kv.prefix_index import PrefixIndex, WorkerView
from cluster.serving.routing import TIER_DEPLOYMENTS, RouteHint, live_replicas, worker_id
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
    prefill_worker: str | None = None  # the worker that computes the prompt (the decode one, colocated)
    prefill_tokens: int = 0  # tokens it computes
    decode_worker: str | None = None
    fallback: str | None = None  # why kv_aware was not used
    local_prefill: bool = False  # the decode worker computes the prompt (computes_locally)
    block_hashes: list[BlockHash] = field(default_factory=list)  # the prompt's reusable blocks (kv_aware)


@dataclass(frozen=True)
class Candidate:
    """A worker as placement weighs it."""

    worker_id: str
    replica: str
    hit_blocks: int  # the prompt's blocks in its prefix cache
    queued_tokens: int  # prompt tokens waiting to be computed there
    requests: int  # requests queued and running there
    kv_usage: float


class InFlight:
    """This gateway's own work on each worker, from placement until done: prompts until
    their first token (the prefill work, and the blocks it computes: then the worker
    publishes them to the index), requests until they finish."""

    def __init__(self) -> None:
        self.prefill_tokens: Counter[str] = Counter()
        self.prefilling: Counter[str] = Counter()
        self.decoding: Counter[str] = Counter()
        self.blocks: dict[str, Counter[BlockHash]] = {}  # worker -> blocks of the prompts it computes

    def requests(self, worker: str, tier: str) -> int:
        return self.prefilling[worker] if tier == "prefill" else self.decoding[worker]

    def hit_blocks(self, worker: str, hashes: list[BlockHash]) -> int:
        """How many leading blocks of a prompt the prompts this gateway has `worker`
        computing cover."""
        held = self.blocks.get(worker)
        if not held:
            return 0
        n = 0
        while n < len(hashes) and hashes[n] in held:  # chain hashes: a hit names its whole prefix
            n += 1
        return n

    def add_blocks(self, worker: str, hashes: list[BlockHash]) -> None:
        if hashes:
            self.blocks.setdefault(worker, Counter()).update(hashes)

    def remove_blocks(self, worker: str, hashes: list[BlockHash]) -> None:
        if not hashes:
            return
        held = self.blocks[worker]
        held.subtract(hashes)
        _drop_zeros(held)
        if not held:
            del self.blocks[worker]


class Placer:
    def __init__(
        self,
        engine: EngineConfig,
        routing: RoutingConfig,
        redis_url: str | None,
        colocated: bool,
        metrics,
        live: Callable[[str], frozenset[str] | None] = live_replicas,
    ):
        """`live(deployment)`: the replica ids Serve routes to now (None: not known yet)."""
        self.config = routing
        self.step_slowdown = engine.scheduler.max_step_slowdown
        self.block_size = engine.cache.block_size
        self.model_id = engine.model_id
        self.colocated = colocated
        self.metrics = metrics
        self.live = live
        self.index = None
        if routing.policy == "kv_aware" and redis_url:
            self.index = PrefixIndex(redis_url, self.model_id, self.block_size, timeout_s=routing.index_timeout_s)
        self.in_flight = InFlight()
        self._last_live: dict[str, frozenset[str]] = {}  # tier -> replicas Serve routed to at the last placement
        self._forgetting: set[asyncio.Task] = set()

    def block_hashes(self, prompt_ids: list[int]) -> list[BlockHash]:
        reusable = num_reusable_blocks(len(prompt_ids), self.block_size) * self.block_size
        return hash_prefix_blocks(prompt_ids[:reusable], self.block_size, self.model_id)

    def live_workers(self) -> dict[str, list[str]]:
        """{tier: worker ids Serve routes to now}, as this gateway sees them."""
        tiers = ("decode",) if self.colocated else ("prefill", "decode")
        return {tier: sorted(worker_id(tier, r) for r in self.live(TIER_DEPLOYMENTS[tier]) or ()) for tier in tiers}

    async def place(self, prompt_ids: list[int], avoid: frozenset[str] = frozenset()) -> Placement:
        """`avoid`: workers that failed this request already (a migration): none of them
        while the tier has another."""
        policy = self.config.policy
        # A disaggregated cluster whose prefill tier has no replica now (the SLO planner
        # scaled it to 0) places as a colocated one: its decode workers compute every prompt.
        colocated = self.colocated or self.live(TIER_DEPLOYMENTS["prefill"]) == frozenset()
        local = colocated and not self.colocated
        if policy in ("round_robin", "power_of_two"):
            hint = RouteHint(policy=policy)
            return Placement(decode=hint, prefill=hint, local_prefill=local)
        hashes = self.block_hashes(prompt_ids)
        affinity = _affinity_key(hashes, prompt_ids)
        views: list[WorkerView] = []
        reason = None
        if policy == "kv_aware":
            views, reason = await self._lookup(hashes, colocated)
            if reason:
                self.metrics.route_fallbacks.labels(reason).inc()
        tiers = {"decode": self._candidates("decode", views, avoid, hashes, colocated)}
        if not colocated:
            tiers["prefill"] = self._candidates("prefill", views, avoid, hashes)
        if any(not c for c in tiers.values()):  # Serve's replica set not known here yet
            hint = RouteHint(affinity_key=affinity)
            return Placement(decode=hint, prefill=hint, fallback=reason, local_prefill=local)
        if policy == "kv_aware" and not reason:
            placement = self._kv_aware(len(prompt_ids), len(hashes), affinity, tiers, colocated)
            placement.block_hashes = hashes
        else:
            placement = self._sticky(len(prompt_ids), affinity, tiers)
            placement.fallback = reason
        placement.local_prefill = placement.local_prefill or local
        return placement

    async def _lookup(self, hashes: list[BlockHash], colocated: bool) -> tuple[list[WorkerView], str | None]:
        if self.index is None:
            return [], "no_index"
        start = time.perf_counter()
        try:
            views = await self.index.lookup(hashes)
        except TimeoutError:
            return [], "index_timeout"
        except Exception:  # noqa: BLE001 - Redis down or refusing: degrade, never fail
            return [], "index_unavailable"
        finally:
            self.metrics.index_lookup.observe(time.perf_counter() - start)
        tiers = {"decode"} if colocated else {"prefill", "decode"}
        if not tiers <= {v.tier for v in views}:
            return views, "index_empty"
        return views, None

    def _candidates(self, tier: str, views: list[WorkerView], avoid: frozenset[str] = frozenset(),
                    hashes: list[BlockHash] = (), colocated: bool = False) -> list[Candidate]:
        """The tier's workers Serve routes to, each with the index's view of it (an empty
        one for a replica the index does not list yet) and this gateway's own load there;
        where the tier computes prompts, also the blocks of those this gateway sent there.
        (Not a disaggregated decode worker's: a prompt's KV lands there only after its
        transfer, and a prompt computed there must not count on it.)"""
        computes = tier == "prefill" or colocated
        indexed = {v.replica: v for v in views if v.tier == tier}
        live = self.live(TIER_DEPLOYMENTS[tier])
        if live is not None:
            self._forget_removed(tier, live)
        replicas = live if live is not None else frozenset(indexed)
        if any(worker_id(tier, r) not in avoid for r in replicas):
            replicas = [r for r in replicas if worker_id(tier, r) not in avoid]
        out = []
        for replica in sorted(replicas):
            wid = worker_id(tier, replica)
            v = indexed.get(replica) or WorkerView(wid, tier, replica, 0, 0, 0, 0.0)
            pending_tokens = self.in_flight.prefill_tokens[wid]
            out.append(Candidate(
                worker_id=wid,
                replica=replica,
                hit_blocks=max(v.hit_blocks, self.in_flight.hit_blocks(wid, hashes) if computes else 0),
                queued_tokens=max(v.queued_tokens, pending_tokens),
                requests=max(v.requests, self.in_flight.requests(wid, tier)),
                kv_usage=v.kv_usage,
            ))
        return out

    def _forget_removed(self, tier: str, live: frozenset[str]) -> None:
        """Replicas Serve routed to before and no longer does (dead or stopped) leave the
        index now. Only those: a replica not seen yet may be new, not gone."""
        removed = self._last_live.get(tier, frozenset()) - live
        self._last_live[tier] = live
        if self.index is None or not removed:
            return
        for replica in removed:
            task = asyncio.get_running_loop().create_task(self._forget(worker_id(tier, replica)))
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)

    async def _forget(self, wid: str) -> None:
        try:
            await self.index.forget(wid)
        except Exception:  # noqa: BLE001 - Redis down: its entries expire anyway
            pass

    def _kv_aware(self, n: int, num_hashes: int, affinity: bytes, tiers: dict[str, list[Candidate]], colocated: bool) -> Placement:
        order = {c.worker_id: rank for rank, c in _by_rendezvous(affinity, [c for cs in tiers.values() for c in cs])}

        def uncached(c: Candidate) -> int:
            return n - min(c.hit_blocks, num_hashes) * self.block_size

        def prefill_cost(c: Candidate) -> float:
            return uncached(c) + c.queued_tokens

        def decode_cost(c: Candidate) -> float:
            full = FULL_PENALTY if c.kv_usage > FULL_KV_USAGE else 0.0
            work = prefill_cost(c) if colocated else self.config.transfer_weight * uncached(c)
            return work + self.config.running_weight * c.requests + full

        costs = {"prefill": prefill_cost, "decode": decode_cost}
        chosen = {
            tier: self._balance(tier, cs, min(cs, key=lambda c, cost=costs[tier]: (cost(c), order[c.worker_id])), order)
            for tier, cs in tiers.items()
        }
        local = not colocated and computes_locally(
            chosen["prefill"], chosen["decode"], uncached(chosen["decode"]), self.step_slowdown, self.config)
        if local:
            self.metrics.local_prefills.inc()
            del chosen["prefill"]  # the decode worker computes it, as colocated
        placement = self._placement(chosen, uncached)
        placement.local_prefill = local
        for tier, c in chosen.items():
            placement.predicted_hits[(tier, c.worker_id)] = n - uncached(c)
        return placement

    def _sticky(self, n: int, affinity: bytes, tiers: dict[str, list[Candidate]]) -> Placement:
        """prefix_hash: the prefix's rendezvous choice of each tier, unless load beats it."""
        chosen = {}
        for tier, cs in tiers.items():
            order = {c.worker_id: rank for rank, c in _by_rendezvous(affinity, cs)}
            first = min(cs, key=lambda c, order=order: order[c.worker_id])
            chosen[tier] = self._balance(tier, cs, first, order)
        return self._placement(chosen, lambda c: n)

    def _balance(self, tier: str, candidates: list[Candidate], choice: Candidate, order: dict[str, int]) -> Candidate:
        """Load beats affinity: the least-loaded worker when `choice` is past the margin,
        unless more prompt tokens queue there (the prompt would start later, not sooner)."""
        least = min(candidates, key=lambda c: (c.requests, c.queued_tokens, order[c.worker_id]))
        if choice.requests - least.requests > self.config.load_margin and least.queued_tokens <= choice.queued_tokens:
            self.metrics.load_overrides.labels(tier).inc()
            return least
        return choice

    def _placement(self, chosen: dict[str, Candidate], prefill_tokens: Callable[[Candidate], int]) -> Placement:
        decode = chosen["decode"]
        computes = chosen.get("prefill", decode)  # colocated: the decode worker computes the prompt
        return Placement(
            decode=RouteHint(replica=decode.replica),
            prefill=RouteHint(replica=computes.replica),
            prefill_worker=computes.worker_id,
            prefill_tokens=prefill_tokens(computes),
            decode_worker=decode.worker_id,
        )

    # ---- this gateway's in-flight work, so a burst does not all land on one worker ----

    def started(self, placement: Placement) -> None:
        for (tier, worker), tokens in placement.predicted_hits.items():
            self.metrics.predicted_hits.labels(tier, worker).inc(tokens)
        if placement.prefill_worker:
            self.in_flight.prefill_tokens[placement.prefill_worker] += placement.prefill_tokens
            self.in_flight.prefilling[placement.prefill_worker] += 1
            self.in_flight.add_blocks(placement.prefill_worker, placement.block_hashes)
        if placement.decode_worker:
            self.in_flight.decoding[placement.decode_worker] += 1

    def first_token(self, placement: Placement) -> None:
        """The prompt is computed: its prefill worker publishes its blocks to the index."""
        if placement.prefill_worker:
            self.in_flight.prefill_tokens[placement.prefill_worker] -= placement.prefill_tokens
            self.in_flight.prefilling[placement.prefill_worker] -= 1
            _drop_zeros(self.in_flight.prefill_tokens, self.in_flight.prefilling)
            self.in_flight.remove_blocks(placement.prefill_worker, placement.block_hashes)
            placement.prefill_worker = None

    def finished(self, placement: Placement) -> None:
        self.first_token(placement)
        if placement.decode_worker:
            self.in_flight.decoding[placement.decode_worker] -= 1
            _drop_zeros(self.in_flight.decoding)
            placement.decode_worker = None


def computes_locally(prefill: Candidate, decode: Candidate, decode_uncached: int, step_slowdown: float,
                     routing: RoutingConfig) -> bool:
    """Whether the decode worker should compute the prompt itself: a short one (at most
    max_local_prefill_tokens uncached: a long one would slow its decodes for many steps)
    that it finishes, after the prompt tokens already queued there, before the prefill
    worker would start it, behind its queue. Both count in tokens of prefill work; while
    requests run there, a decode worker computes prompt tokens at (s - 1) / s of a prefill
    worker's rate (its step budget, s = max_step_slowdown, keeps each step within s decode
    steps' time; s = 0: no cap, full rate), and every step of theirs is slower meanwhile:
    so beside requests only a saturated prefill tier (saturated_prefill_queue_tokens queued)
    gets help, and a tier that keeps up keeps every prompt, the decodes their ITL."""
    if decode_uncached > routing.max_local_prefill_tokens:
        return False
    if decode.requests and prefill.queued_tokens < routing.saturated_prefill_queue_tokens:
        return False
    slower = step_slowdown / (step_slowdown - 1.0) if decode.requests and step_slowdown > 0 else 1.0
    return prefill.queued_tokens > slower * (decode.queued_tokens + decode_uncached)


def _affinity_key(hashes: list[BlockHash], prompt_ids: list[int]) -> bytes:
    if hashes:
        return hashes[min(len(hashes), PREFIX_HASH_BLOCKS) - 1]  # a chain hash names its whole prefix
    return hashlib.blake2b(repr(prompt_ids).encode(), digest_size=16).digest()


def _by_rendezvous(affinity: bytes, candidates: list[Candidate]) -> list[tuple[int, Candidate]]:
    by_replica = {c.replica: c for c in candidates}
    return list(enumerate(by_replica[r] for r in rendezvous_order(affinity, list(by_replica))))


def _drop_zeros(*counters: Counter) -> None:
    for counter in counters:
        for key in [k for k, v in counter.items() if v <= 0]:
            del counter[key]
