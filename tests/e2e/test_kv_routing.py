"""KV-cache-aware routing on a real local cluster with 2 prefill workers and a real
redis-server: a shuffled shared-prefix workload gets (nearly) the ideal prefix hits
under kv_aware and clearly fewer under round_robin; what the index promised equals
what the workers found; with Redis killed every request still completes (the fallback
is counted) and once Redis is back the index recovers with no worker restarted; and a
prefill tier that falls behind gets help from the decode tier (conditional disaggregation)."""

import asyncio
import json
import random
from pathlib import Path

import psutil
import pytest

from cluster.config import GatewayConfig, RoutingConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.kv.hashing import hash_prefix_blocks
from cluster.launch.redis_server import PrivateRedis
from tests.e2e.conftest import API_KEY
from tests.e2e.test_gateway_edge import metric
from tests.helpers import all_blocks_returned, wait_until

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
NUM_PREFIXES, SUFFIXES_PER_PREFIX, PREFIX_LEN, SUFFIX_LEN = 8, 3, 64, 10


def workload(seed: int, vocab: int) -> list[list[int]]:
    """NUM_PREFIXES long prefixes, each with SUFFIXES_PER_PREFIX suffixes, shuffled."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    prompts = [p + [rng.randrange(10, vocab) for _ in range(SUFFIX_LEN)] for p in prefixes for _ in range(SUFFIXES_PER_PREFIX)]
    rng.shuffle(prompts)
    return prompts


def ideal_hit_tokens(prompts: list[list[int]], block_size: int, model_id: str) -> int:
    """Hits of one cache that never forgets: each prompt's reusable blocks seen before."""
    seen, total = set(), 0
    for ids in prompts:
        hashes = hash_prefix_blocks(ids[: (len(ids) - 1) // block_size * block_size], block_size, model_id)
        hit = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        total += hit * block_size
        seen.update(hashes)
    return total


def hit_tokens(handle) -> dict[str, int]:
    stats = handle.worker_stats.remote().result()
    return {tier: sum(s["prefix_hit_tokens"] for s in workers.values()) for tier, workers in stats.items()}


def run(handle, prompts) -> None:
    for ids in prompts:  # one at a time: each lookup sees what the previous request cached
        outs = list(handle.options(stream=True).generate.remote(ids, GREEDY))
        assert outs[-1].finish_reason == "length"


def scrape(live) -> str:
    return live.scrape()


@pytest.fixture(scope="module")
def vocab(engine_config):
    return json.loads((Path(engine_config.model) / "config.json").read_text())["vocab_size"]


def test_kv_aware_gets_the_ideal_hits_and_round_robin_does_not(live, engine_config, vocab):
    results = {}
    for seed, policy in enumerate(("kv_aware", "round_robin")):
        handle = live.redeploy(prefills=2, routing=RoutingConfig(policy=policy))
        prompts = workload(seed, vocab)  # fresh prefixes: earlier caches do not help
        ideal = ideal_hit_tokens(prompts, engine_config.cache.block_size, engine_config.model_id)
        before, predicted_before = hit_tokens(handle), metric(scrape(live), "pdserve_route_predicted_hit_tokens_total", tier="prefill")
        run(handle, prompts)
        after = hit_tokens(handle)
        actual = after["prefill"] - before["prefill"]
        predicted = metric(scrape(live), "pdserve_route_predicted_hit_tokens_total", tier="prefill") - predicted_before
        results[policy] = (actual, ideal, predicted)
    print("prefill hit tokens (actual, ideal, predicted):", results)
    kv_actual, kv_ideal, kv_predicted = results["kv_aware"]
    rr_actual, rr_ideal, _ = results["round_robin"]
    assert kv_ideal > 0 and kv_actual >= 0.85 * kv_ideal, results
    assert kv_predicted == kv_actual, results  # the index told the truth
    assert rr_actual / rr_ideal < 0.8 * kv_actual / kv_ideal, results
    assert metric(scrape(live), "pdserve_route_fallbacks_total") == 0


def test_a_second_turn_lands_where_the_first_turns_kv_is(live, engine_config, vocab):
    handle = live.redeploy(prefills=2, routing=RoutingConfig(policy="kv_aware"))
    rng = random.Random(99)
    first_turn = [rng.randrange(10, vocab) for _ in range(40)]
    outs = list(handle.options(stream=True).generate.remote(first_turn, GREEDY))
    reply = [t for o in outs for t in o.new_token_ids]
    before = handle.worker_stats.remote().result()
    second_turn = first_turn + reply + [rng.randrange(10, vocab) for _ in range(12)]
    list(handle.options(stream=True).generate.remote(second_turn, GREEDY))
    after = handle.worker_stats.remote().result()
    for tier in ("prefill", "decode"):
        gained = {w: after[tier][w]["prefix_hit_tokens"] - before[tier][w]["prefix_hit_tokens"] for w in after[tier]}
        # One worker of the tier found the whole first turn (whole blocks of it) in its cache.
        assert max(gained.values()) >= 40 // engine_config.cache.block_size * engine_config.cache.block_size, (tier, gained)


def test_redis_down_degrades_to_prefix_hash_and_recovers_when_back(live, engine_config, vocab):
    with PrivateRedis() as index_redis:
        handle = live.redeploy(prefills=2, routing=RoutingConfig(policy="kv_aware"), redis_url=index_redis.url,
                               gateway=GatewayConfig(api_keys=(API_KEY,)))
        prompts = workload(7, vocab)
        run(handle, prompts[:6])
        assert metric(scrape(live), "pdserve_route_fallbacks_total") == 0
        index_redis.stop()
        run(handle, prompts[6:12])  # every request completes ...
        assert metric(scrape(live), "pdserve_route_fallbacks_total", reason="index_unavailable") == 6  # ... degraded, counted
        back = PrivateRedis(port=index_redis.port, password_file=index_redis.password_file)  # empty: the workers must republish
        try:
            assert wait_until(
                lambda: all(s["index"]["snapshots"] >= 2 for t in handle.worker_stats.remote().result().values() for s in t.values()),
                timeout_s=20,
            )
            predicted_before = metric(scrape(live), "pdserve_route_predicted_hit_tokens_total", tier="prefill")
            before = hit_tokens(handle)
            run(handle, prompts[12:])
            predicted = metric(scrape(live), "pdserve_route_predicted_hit_tokens_total", tier="prefill") - predicted_before
            actual = hit_tokens(handle)["prefill"] - before["prefill"]
            assert metric(scrape(live), "pdserve_route_fallbacks_total") == 6  # no new fallback
            assert predicted == actual > 0  # the recovered index is true again
        finally:
            live.redeploy()
            back.stop()


def _local_prefills(handle) -> int:
    return sum(s["local_prefills"] for s in handle.worker_stats.remote().result()["decode"].values())


@pytest.mark.parametrize("max_local", [512, 0])
def test_a_prefill_tier_that_falls_behind_gets_help_from_the_decode_tier(live, wide_model_config, max_local):
    """A burst of 200-token prompts onto a prefill replica that has fallen behind (stopped,
    SIGSTOP, until the burst is placed: behind whatever the machine's speed): with local
    prefill allowed (max_local_prefill_tokens 512), once its queue is saturated (three
    prompts, saturated_prefill_queue_tokens 600) and would start a prompt later than the
    decode worker can finish it (beside requests at a sixth of the rate: decode_step_slowdown
    1.2; so the eighth prompt), the decode worker computes it itself (no transfer); the
    first prompts still go to the prefill tier. With 0, all go there. Outputs are the
    undisturbed greedy ones either way, and every block returns."""
    routing = RoutingConfig(max_local_prefill_tokens=max_local, saturated_prefill_queue_tokens=600)
    handle = live.redeploy(routing=routing, engine=wide_model_config)
    reference = Engine(wide_model_config)
    rng = random.Random(max_local)  # prompts of its own: no cache holds them (replicas outlive a redeploy)
    prompts = [[rng.randrange(10, reference.loaded.arch.vocab_size) for _ in range(200)] for _ in range(8)]
    expected = [c.token_ids for c in reference.generate(prompts, GREEDY)]
    before_local, before_metric = _local_prefills(handle), metric(scrape(live), "pdserve_route_local_prefills_total")
    received_before = sum(s["transport"]["transfers_ok"] for s in handle.worker_stats.remote().result()["decode"].values())

    (prefill_pid,) = [s["pid"] for s in handle.worker_stats.remote().result()["prefill"].values()]
    prefill = psutil.Process(prefill_pid)

    async def burst():
        async def one(ids):
            return [t async for out in handle.options(stream=True).generate.remote(ids, GREEDY) for t in out.new_token_ids]

        if not max_local:  # every prompt goes to the prefill tier, however far behind it is
            return await asyncio.gather(*(one(ids) for ids in prompts))
        prefill.suspend()
        try:
            outputs = asyncio.gather(*(one(ids) for ids in prompts))
            def decode_computed_one() -> bool:  # (a stats poll with a deadline: the stopped prefill replica never answers)
                stats, _ = handle.poll_workers.remote(2.0).result()
                return sum(s["local_prefills"] for s in stats["decode"].values()) > before_local

            helped = await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_until(decode_computed_one, timeout_s=30, interval_s=0.2))
            assert helped  # prompts computed where they decode while the prefill tier stood still
        finally:
            prefill.resume()
        return await outputs

    assert asyncio.run(burst()) == expected
    local = _local_prefills(handle) - before_local
    received = sum(s["transport"]["transfers_ok"] for s in handle.worker_stats.remote().result()["decode"].values()) - received_before
    assert metric(scrape(live), "pdserve_route_local_prefills_total") - before_metric == local
    if max_local:
        assert 1 <= local < len(prompts) and received == len(prompts) - local
    else:
        assert local == 0 and received == len(prompts)
    assert wait_until(lambda: all_blocks_returned(handle), timeout_s=60)
