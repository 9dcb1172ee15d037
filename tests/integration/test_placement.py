"""Placement decisions against a real prefix index (redis-server, real publishers):
the candidates are the replicas Serve routes to, not only the indexed ones; a replica
the index does not list yet counts with an empty cache and no load; one Serve removed
gets nothing; and load beats affinity past `load_margin`, for kv_aware and prefix_hash,
but never toward a longer queue of prompt tokens.
Conditional disaggregation: a short prompt goes to its decode worker only when the prefill
queue would start it later than the decode worker finishes it.
(The same rules on a live cluster: tests/integration/test_cluster.py.)"""

import asyncio

import pytest

from cluster.config import CacheConfig, EngineConfig, RoutingConfig
from cluster.engine.kv_cache_manager import num_reusable_blocks
from cluster.kv.hashing import hash_prefix_blocks
from cluster.launch.redis_server import PrivateRedis
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


def placer(url, live: dict[str, set[str]], policy="kv_aware", margin=4, max_local=0, saturated=0):
    """max_local (max_local_prefill_tokens): 0 unless a test is about it, so that a burst's
    growing prefill queue does not move prompts to the decode tier in tests of the tiers'
    own choices; saturated (saturated_prefill_queue_tokens): 0 unless a test is about it."""
    metrics = GatewayMetrics("t")
    routing = RoutingConfig(policy=policy, load_margin=margin, max_local_prefill_tokens=max_local,
                            saturated_prefill_queue_tokens=saturated)
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


def distinct(i: int) -> list[int]:
    """A prompt as long as PROMPT that shares no block with it or with distinct(j != i)."""
    return [t + 10_000 * (i + 1) for t in PROMPT]


def place(p, n=1, prompts=None):
    """Place n prompts (PROMPT each, unless `prompts(i)` says), each running once placed."""
    async def go():
        out = []
        for i in range(n):
            out.append(await p.place(prompts(i) if prompts else PROMPT))
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
    balanced_by_count = ("prefill", "decode") if policy == "prefix_hash" else ("decode",)
    for tier in balanced_by_count:
        chosen = [getattr(pl, tier).replica for pl in placements]
        counts = {r: chosen.count(r) for r in set(chosen)}
        assert len(counts) == 2 and min(counts.values()) >= 16 // 4, (tier, counts)
        assert max(counts.values()) - min(counts.values()) <= 4 + 1  # never past the margin (+ the one placed)
    if policy == "kv_aware":
        # A prefill worker's queue is counted in prompt tokens: p1 computes 3 per request
        # (its cache holds the rest), p2 all 67. p2 took one when p1 was past the margin;
        # then p1's queue stayed the shorter, so a second move would start a prompt later.
        queued = p.in_flight.prefill_tokens
        assert {pl.prefill.replica for pl in placements} == {"p1", "p2"}
        assert queued["p1"] <= queued["p2"] <= queued["p1"] + len(PROMPT)
    # prefix_hash knows no load but by the margin rule; kv_aware's decode cost weighs load itself.
    assert metrics.load_overrides.labels("prefill")._value.get() > 0
    assert (metrics.load_overrides.labels("decode")._value.get() > 0) == (policy == "prefix_hash")


def test_load_does_not_move_a_prompt_behind_more_queued_prompt_tokens(redis_url):
    """A burst of short hot-prefix prompts on p1 and one cold long prompt on p2: p1 is past
    the margin in requests, but its queue is shorter in tokens, so it keeps the next one
    (moved, it would wait behind the cold prompt and compute all of its own)."""
    publish(redis_url, ("prefill", "p1", {"cached": HASHES}), ("prefill", "p2", {}),
            ("decode", "d1", {}), ("decode", "d2", {}))
    p, metrics = placer(redis_url, {"prefill": {"p1", "p2"}, "decode": {"d1", "d2"}}, margin=4)
    cold = list(range(5000, 5000 + len(PROMPT)))

    async def go():
        placed = []
        for prompt in [PROMPT] * 4 + [cold] + [PROMPT] * 8:
            placed.append(await p.place(prompt))
            p.started(placed[-1])
        return placed
    placed = asyncio.run(go())
    assert all(pl.fallback is None for pl in placed)
    assert [pl.prefill.replica for pl in placed[:4]] == ["p1"] * 4
    assert placed[4].prefill.replica == "p2"  # both would compute all of it: the shorter queue
    # p1 goes past the margin (5 and more requests against 1), but its queue stays the
    # shorter in tokens (3 per request against 67).
    assert [pl.prefill.replica for pl in placed[5:]] == ["p1"] * 8
    assert metrics.load_overrides.labels("prefill")._value.get() == 0


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


def test_a_prompt_goes_to_the_prefill_tier_while_it_keeps_up(redis_url):
    """An idle prefill tier (or one whose queue is shorter than the decode worker's work for
    the prompt at its step budget's rate) computes every prompt: decodes keep their ITL."""
    publish(redis_url, ("prefill", "p1", {}), ("decode", "d1", {"running": 8}))
    p, metrics = placer(redis_url, {"prefill": {"p1"}, "decode": {"d1"}}, max_local=512)
    (first, second) = place(p, 2)  # the second waits behind the first's 67 tokens: 67 < 2 x 67
    assert not first.local_prefill and not second.local_prefill
    assert first.prefill.replica == second.prefill.replica == "p1"
    assert metrics.local_prefills._value.get() == 0


@pytest.mark.parametrize("saturated_prompts", [0, 5])
def test_a_prompt_goes_to_its_decode_worker_when_the_prefill_queue_would_start_it_later(redis_url, saturated_prompts):
    """Placed in a burst: once the prefill worker's queue holds more than twice the decode
    worker's own prompt work (max_step_slowdown 2: it computes prompts at half rate beside its
    decodes) and, beside running requests, has reached saturated_prefill_queue_tokens,
    prompts are computed where they decode; both tiers then share the burst."""
    n = len(PROMPT)
    publish(redis_url, ("prefill", "p1", {}), ("decode", "d1", {"running": 8}))
    p, metrics = placer(redis_url, {"prefill": {"p1"}, "decode": {"d1"}}, max_local=512, saturated=saturated_prompts * n)
    placements = place(p, 12, prompts=distinct)  # one prompt 12 times would be computed once
    local = [pl.local_prefill for pl in placements]
    first_local = max(3, saturated_prompts)  # queue 3n > 2 x (0 + n), and saturated
    assert not any(local[:first_local]) and local[first_local]
    assert 2 <= sum(local) <= 5 and metrics.local_prefills._value.get() == sum(local)
    # each local prompt is the decode worker's work now (this gateway's in-flight count)
    assert p.in_flight.prefill_tokens["decode-d1"] == sum(local) * n
    assert all(pl.prefill_worker == "decode-d1" for pl in placements if pl.local_prefill)
    p.first_token(placements[first_local])  # its first token: no longer prompt work anywhere
    assert p.in_flight.prefill_tokens["decode-d1"] == (sum(local) - 1) * n


@pytest.mark.parametrize("max_local", [0, len(PROMPT) - 1])
def test_a_prompt_longer_than_the_local_cap_always_goes_to_the_prefill_tier(redis_url, max_local):
    """Above max_local_prefill_tokens (0: every prompt) a prompt goes to the prefill tier
    however long its queue: beside decodes it would slow them for many steps."""
    publish(redis_url, ("prefill", "p1", {}), ("decode", "d1", {"running": 8}))
    p, metrics = placer(redis_url, {"prefill": {"p1"}, "decode": {"d1"}}, max_local=max_local)
    assert not any(pl.local_prefill for pl in place(p, 12))
    assert metrics.local_prefills._value.get() == 0


def test_a_burst_of_a_new_prefix_goes_where_its_first_prompt_is_computing(redis_url):
    """Before any worker has published the prefix, the prompts this gateway sent to compute
    it count as that worker's cache: the burst lands there and its engine computes the
    prefix once (the scheduler waits for it), while a prompt with another prefix goes to the
    shorter queue. After the first token the index is the worker's word again."""
    publish(redis_url, ("prefill", "p1", {}), ("prefill", "p2", {}), ("decode", "d1", {}))
    p, metrics = placer(redis_url, {"prefill": {"p1", "p2"}, "decode": {"d1"}})
    prompts = [PROMPT, distinct(0), PROMPT, PROMPT, PROMPT]
    placements = place(p, len(prompts), prompts=lambda i: prompts[i])
    first = placements[0].prefill.replica
    other = ({"p1", "p2"} - {first}).pop()
    assert [pl.prefill.replica for pl in placements] == [first, other, first, first, first]
    suffix = len(PROMPT) - len(HASHES) * BS  # the tokens its cache cannot hold
    assert [pl.predicted_hits[("prefill", f"prefill-{first}")] for pl in placements[2:]] == [len(HASHES) * BS] * 3
    assert p.in_flight.prefill_tokens[f"prefill-{first}"] == len(PROMPT) + 3 * suffix
    for pl in placements:
        p.first_token(pl)
    assert not p.in_flight.blocks  # every prompt computed: nothing predicted from this gateway


def test_a_decode_worker_does_not_count_the_kv_it_is_still_to_receive(redis_url):
    """Disaggregated, a prompt's KV reaches its decode worker only after the transfer: a
    second prompt of the same prefix placed meanwhile must not be computed there (local
    prefill) as if the prefix were cached."""
    publish(redis_url, ("prefill", "p1", {}), ("decode", "d1", {"running": 8}))
    p, _ = placer(redis_url, {"prefill": {"p1"}, "decode": {"d1"}}, max_local=512)
    placements = place(p, 4)
    assert not any(pl.local_prefill for pl in placements)
    assert all(pl.predicted_hits[("decode", "decode-d1")] == 0 for pl in placements)


@pytest.mark.parametrize("policy", ["kv_aware", "prefix_hash", "round_robin"])
def test_a_prefill_tier_with_no_replica_has_the_decode_workers_compute_every_prompt(redis_url, policy):
    """The SLO planner may scale the prefill tier to 0: then every prompt is placed on a
    decode worker as in a colocated cluster (local_prefill, the decode worker's cache
    counts as a prompt's), and once a prefill replica is back the prefill tier computes again."""
    publish(redis_url, ("decode", "d1", {}), ("decode", "d2", {"cached": HASHES}))
    live = {"prefill": set(), "decode": {"d1", "d2"}}
    p, _ = placer(redis_url, live, policy=policy)
    placements = place(p, 3)
    assert all(pl.local_prefill for pl in placements)
    if policy != "round_robin":
        assert {pl.decode_worker for pl in placements} <= {"decode-d1", "decode-d2"}
        assert all(pl.prefill_worker == pl.decode_worker for pl in placements)
    if policy == "kv_aware":
        assert placements[0].decode_worker == "decode-d2"  # the one holding the prefix
    live["prefill"] = {"p1"}
    publish(redis_url, ("prefill", "p1", {}))
    (back,) = place(p)
    assert not back.local_prefill
    if policy != "round_robin":
        assert back.prefill_worker == "prefill-p1"
