"""Placement decisions against a real prefix index (redis-server, real publishers):
the candidates are the replicas Serve routes to, not only the indexed ones; a replica
the index does not list yet counts with an empty cache and no load; one Serve removed
gets nothing; and load beats affinity past `load_margin`, for kv_aware and prefix_hash.
(The same rules on a live cluster: tests/integration/test_cluster.py.)"""

import asyncio

import pytest

from cluster.config import CacheConfig, EngineConfig, RoutingConfig
from cluster.engine.kv_cache_manager import num_reusable_blocks
from cluster.kv.hashing import hash_prefix_blocks
from cluster.redis_server import PrivateRedis
from router.metrics import GatewayMetrics
from router.placement import PREFIX_HASH_BLOCKS, Placer
from router.replica_router import rendezvous_order
from tests.helpers import IndexedWorker

BS = 8
CONFIG = EngineConfig(model="/models/m", served_model_name="m", cache=CacheConfig(block_size=BS))
PROMPT = list(range(1000, 1000 + 8 * BS + 3))  # 8 full blocks and 3 tokens
HASHES = hash_prefix_blocks(PROMPT[: num_reusable_blocks(len(PROMPT), BS) * BS], BS, "m")


@pytest.fixture
def redis_url():
    with PrivateRedis() as r:
        yield r.url


def placer(url, live: dict[str, set[str]], policy="kv_aware", margin=4):
    metrics = GatewayMetrics("t")
    routing = RoutingConfig(policy=policy, load_margin=margin)
    names = {"PrefillWorker": "prefill", "DecodeWorker": "decode"}
    return Placer(CONFIG, routing, url, False, metrics, live=lambda d: frozenset(live[names[d]])), metrics


def publish(url, *workers_args):
    async def go():
        workers = []
        for tier, replica, kw in workers_args:
            w = IndexedWorker(url, f"{tier}-{replica}", tier, "m", BS,
                              load={"queued_tokens": 0, "waiting": kw.get("waiting", 0), "running": kw.get("running", 0)})
            w.cache(kw.get("cached", ()))
            workers.append(w)
        for w in workers:
            assert await w.publisher.sync()
        return workers
    return asyncio.run(go())


def place(p, n=1):
    async def go():
        out = []
        for _ in range(n):
            out.append(await p.place(PROMPT))
            p.started(out[-1])  # placed and running: this gateway counts it
        return out
    return asyncio.run(go())


def test_a_replica_the_index_does_not_list_yet_counts_empty_and_idle(redis_url):
    publish(redis_url, ("prefill", "p1", {"cached": HASHES, "running": 6}), ("decode", "d1", {"cached": HASHES, "running": 6}))
    p, metrics = placer(redis_url, {"prefill": {"p1", "p2"}, "decode": {"d1", "d2"}})  # p2, d2: just started
    (first,) = place(p)
    # p1 and d1 hold the prefix but run 6 requests each; the new replicas run none.
    assert (first.prefill.replica, first.decode.replica) == ("p2", "d2")
    # Prefill's cost is in tokens, so the margin rule moved it; decode's cost already
    # weighs its running requests (running_weight), so its cost alone chose d2.
    assert metrics.load_overrides.labels("prefill")._value.get() == 1


def test_a_replica_serve_removed_gets_nothing_even_if_indexed(redis_url):
    publish(redis_url, ("prefill", "p1", {"cached": HASHES}), ("prefill", "p2", {}), ("decode", "d1", {}))
    p, _ = placer(redis_url, {"prefill": {"p2"}, "decode": {"d1"}})  # p1 is being stopped
    assert {pl.prefill.replica for pl in place(p, 4)} == {"p2"}


@pytest.mark.parametrize("policy", ["kv_aware", "prefix_hash"])
def test_load_beats_affinity_for_one_hot_prefix(redis_url, policy):
    publish(redis_url, ("prefill", "p1", {"cached": HASHES}), ("prefill", "p2", {}),
            ("decode", "d1", {"cached": HASHES}), ("decode", "d2", {}))
    p, metrics = placer(redis_url, {"prefill": {"p1", "p2"}, "decode": {"d1", "d2"}}, policy=policy, margin=4)
    placements = place(p, 16)  # one prefix, all running at once
    for tier in ("prefill", "decode"):
        chosen = [getattr(pl, tier).replica for pl in placements]
        counts = {r: chosen.count(r) for r in set(chosen)}
        assert len(counts) == 2 and min(counts.values()) >= 16 // 4, (tier, counts)
        assert max(counts.values()) - min(counts.values()) <= 4 + 1  # never past the margin (+ the one placed)
    # prefix_hash knows no load but by the margin rule; kv_aware's decode cost weighs load itself.
    assert metrics.load_overrides.labels("prefill")._value.get() > 0
    assert (metrics.load_overrides.labels("decode")._value.get() > 0) == (policy == "prefix_hash")


@pytest.mark.parametrize("policy", ["kv_aware", "prefix_hash"])
def test_within_the_margin_affinity_wins(redis_url, policy):
    home, other = rendezvous_order(HASHES[PREFIX_HASH_BLOCKS - 1], ["p1", "p2"])  # prefix_hash's choice
    publish(redis_url, ("prefill", home, {"cached": HASHES, "running": 4}), ("prefill", other, {}),
            ("decode", "d1", {}), ("decode", "d2", {}))
    p, metrics = placer(redis_url, {"prefill": {"p1", "p2"}, "decode": {"d1", "d2"}}, policy=policy, margin=4)
    (pl,) = place(p)
    assert pl.prefill.replica == home  # its cache (kv_aware) or the prefix's hash wins: 4 requests is within 4
    assert metrics.load_overrides.labels("prefill")._value.get() == 0


def test_without_serve_s_replica_set_placement_defers_to_serve(redis_url):
    p = Placer(CONFIG, RoutingConfig(policy="prefix_hash"), None, False, GatewayMetrics("t"), live=lambda d: None)
    (pl,) = place(p)
    assert pl.decode.replica is None and pl.decode.affinity_key is not None  # Serve's request router hashes it


def test_a_replica_serve_drops_leaves_the_index_at_once(redis_url):
    publish(redis_url, ("prefill", "p1", {"cached": HASHES}), ("prefill", "p2", {}), ("decode", "d1", {}))
    live = {"prefill": {"p1", "p2"}, "decode": {"d1"}}
    p, _ = placer(redis_url, live)

    async def go():
        await p.place(PROMPT)
        live["prefill"].discard("p1")  # Serve dropped p1 (it died): no TTL wait
        await p.place(PROMPT)
        await asyncio.gather(*p._forgetting)
        return {v.worker_id for v in await p.index.lookup(HASHES)}

    assert asyncio.run(go()) == {"prefill-p2", "decode-d1"}  # without forget, p1 would count for TTL_S more
