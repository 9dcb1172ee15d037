"""The disaggregated cluster on a real local Ray: Serve deployments, KV over gloo.

Greedy tokens through prefill + decode workers equal the colocated engine's, for
concurrent requests of mixed lengths (longer than the prefill chunk, shared prefixes),
in 1P1D, 2P1D and 1P2D; cancelled streams and failed transfers return every block.
"""

import asyncio
import dataclasses

import pytest
import ray
from ray import serve

from cluster.config import CacheConfig, ClusterConfig, EngineConfig, SchedulerConfig, TierConfig, TransportConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError
from cluster.host import local_ray
from cluster.launch.app import build_app
from tests.helpers import all_blocks_returned, wait_until

SHARED = "You are a helpful assistant. Answer briefly and precisely, citing sources. "
PROMPTS = [
    "Hi",
    SHARED + "What is the capital of France?",
    SHARED + "What is the capital of Italy?",
    "Tell me a story about a fox " * 6,
    SHARED * 2 + "And Spain?",
    "Short prompt number six",
    "Numbers: " + " ".join(str(i) for i in range(40)),
    SHARED + "Summarise the plot of Hamlet.",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_local():
    local_ray.init(8, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def engine_config(tiny_models):
    return EngineConfig(
        model=str(tiny_models["qwen2"]),
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(block_size=8, num_blocks=160),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),  # prompts above 32 tokens are chunked
    )


@pytest.fixture(scope="module")
def expected(engine_config):
    return [c.token_ids for c in Engine(engine_config).generate(PROMPTS, GREEDY)]


def deploy(engine_config, prefill=1, decode=1, colocated=False, transport=TransportConfig(timeout_s=10.0)):
    config = ClusterConfig(
        engine=engine_config,
        prefill=TierConfig(num_replicas=prefill, num_cpus=0.5),
        decode=TierConfig(num_replicas=decode, num_cpus=0.5),
        router=TierConfig(num_cpus=0.1),
        transport=transport,
        colocated=colocated,
    )
    return serve.run(build_app(config), name="pdserve", route_prefix=None)


async def collect(router, prompt, params=GREEDY):
    tokens, finish = [], None
    async for out in router.options(stream=True).generate.remote(prompt, params):
        tokens += out.new_token_ids
        finish = out.finish_reason
    return tokens, finish


async def run_all(router, prompts=PROMPTS, params=GREEDY):
    return await asyncio.gather(*(collect(router, p, params) for p in prompts))


@pytest.mark.parametrize("prefill, decode", [(1, 1), (2, 1), (1, 2)])
def test_disaggregated_equals_colocated(ray_local, engine_config, expected, prefill, decode):
    router = deploy(engine_config, prefill, decode)

    def bytes_moved():
        stats = router.worker_stats.remote().result()
        assert len(stats["prefill"]) == prefill and len(stats["decode"]) == decode
        sent = sum(s["transport"]["bytes_sent"] for s in stats["prefill"].values())
        return sent, sum(s["transport"]["bytes_received"] for s in stats["decode"].values())

    # Replicas kept from an earlier deployment (a redeploy only rescales) keep their counters.
    sent_before, received_before = bytes_moved()
    results = asyncio.run(run_all(router))
    assert [t for t, _ in results] == expected
    assert all(f == "length" for _, f in results)
    sent, received = bytes_moved()
    assert sent - sent_before == received - received_before > 0
    # One host: every payload went through shared memory, none through the sockets.
    transports = [s["transport"] for s in router.worker_stats.remote().result()["decode"].values()]
    assert all(t["transfers_shared_memory"] == t["transfers_ok"] for t in transports)
    assert wait_until(lambda: all_blocks_returned(router))


def test_a_one_token_request_never_touches_the_decode_tier(ray_local, engine_config, expected):
    router = deploy(engine_config)

    def counts():
        stats = router.worker_stats.remote().result()
        (d,), (p,) = stats["decode"].values(), stats["prefill"].values()
        return sum(d["finished"].values()), d["transport"]["transfers_ok"], sum(p["finished"].values())

    decoded, received, prefilled = counts()
    tokens, finish = asyncio.run(collect(router, PROMPTS[1], dataclasses.replace(GREEDY, max_tokens=1)))
    assert tokens == expected[1][:1] and finish == "length"
    assert counts() == (decoded, received, prefilled + 1)
    assert wait_until(lambda: all_blocks_returned(router))


def test_tight_kv_caches_wait_and_preempt_but_tokens_stay_equal(ray_local, engine_config, expected):
    """34 blocks of 8 tokens per worker: the 8 concurrent requests do not fit at once, so
    decode reservations wait and running requests are preempted and recomputed."""
    tight = dataclasses.replace(engine_config, cache=dataclasses.replace(engine_config.cache, num_blocks=34))
    router = deploy(tight)
    assert [t for t, _ in asyncio.run(run_all(router))] == expected
    assert wait_until(lambda: all_blocks_returned(router))


def test_colocated_mode_matches(ray_local, engine_config, expected):
    router = deploy(engine_config, colocated=True)
    assert [t for t, _ in asyncio.run(run_all(router))] == expected


def test_bad_input_is_refused_at_the_router(ray_local, engine_config):
    router = deploy(engine_config)

    async def bad():
        async for _ in router.options(stream=True).generate.remote("", GREEDY):
            pass

    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        asyncio.run(bad())
    tokens, finish = asyncio.run(collect(router, "still serving"))
    assert len(tokens) == 12 and finish == "length"


def test_cancelled_stream_aborts_and_frees_blocks_on_both_tiers(ray_local, engine_config):
    router = deploy(dataclasses.replace(engine_config, max_model_len=512))
    long = dataclasses.replace(GREEDY, max_tokens=500)  # seconds of decoding: the abort comes first

    async def cancel_after_two():
        got = 0
        stream = router.options(stream=True).generate.remote(PROMPTS[0], long)
        async for _ in stream:
            got += 1
            if got == 2:
                stream.cancel()  # the consumer goes away mid-stream (as Serve does on a disconnect)
                break
        return got

    assert asyncio.run(cancel_after_two()) == 2
    assert wait_until(lambda: all_blocks_returned(router))
    stats = router.worker_stats.remote().result()
    (decode,) = stats["decode"].values()
    assert decode["finished"] == {"abort": 1}


def served(router, tier: str) -> dict[str, int]:
    """Requests each worker of `tier` has finished (prefill workers finish each prompt once)."""
    return {wid: sum(s["finished"].values()) for wid, s in router.worker_stats.remote().result()[tier].items()}


def knows(router, tier: str, n: int) -> bool:
    """The gateway's placement sees `n` replicas of `tier`: Serve routes to them all."""
    return len(router.live_workers.remote().result()[tier]) == n


@pytest.mark.parametrize("tier", ["decode", "prefill"])
def test_a_new_replica_takes_its_share_at_once_and_leaves_cleanly(ray_local, engine_config, expected, tier):
    """Scale `tier` from 1 to 2 replicas while long streams run: nothing restarts, the
    streams go on, and the next 16 requests (8 prompts, 5 distinct prefixes) give the new
    replica at least a quarter, because load beats affinity; then scale back down."""
    config = dataclasses.replace(engine_config, max_model_len=512)
    router = deploy(config)
    (first,) = router.worker_stats.remote().result()[tier]
    long = dataclasses.replace(GREEDY, max_tokens=400)
    scaled = {"prefill": 2 if tier == "prefill" else 1, "decode": 2 if tier == "decode" else 1}

    async def scale_while_streaming():
        streams = [asyncio.ensure_future(collect(router, p, long)) for p in PROMPTS[:6]]
        await asyncio.sleep(0.5)
        await asyncio.to_thread(deploy, config, scaled["prefill"], scaled["decode"])
        assert await asyncio.to_thread(wait_until, lambda: knows(router, tier, 2))
        before = await asyncio.to_thread(served, router, tier)
        results = await run_all(router, PROMPTS * 2)
        return before, results, await asyncio.gather(*streams)

    before, results, streams = asyncio.run(scale_while_streaming())
    assert all(len(t) == 400 and f == "length" for t, f in streams)  # the running streams were not interrupted
    assert [t for t, _ in results] == expected * 2
    after = served(router, tier)
    assert len(after) == 2 and first in after  # the first replica was not restarted
    (new,) = set(after) - {first}
    assert after[new] - before.get(new, 0) >= 16 // 4, (before, after)

    deploy(config)  # scale back down: the replica that goes takes no new work
    assert wait_until(lambda: knows(router, tier, 1))
    assert [t for t, _ in asyncio.run(run_all(router))] == expected
    assert wait_until(lambda: len(router.worker_stats.remote().result()[tier]) == 1)
    assert wait_until(lambda: all_blocks_returned(router))


def test_one_hot_prefix_spreads_over_both_decode_replicas(ray_local, engine_config):
    """16 requests at once behind one shared prefix (one affinity): load beats affinity,
    so neither decode replica takes them all."""
    router = deploy(engine_config, decode=2)
    assert wait_until(lambda: knows(router, "decode", 2))
    before = served(router, "decode")
    prompts = [SHARED * 2 + f"Question number {i}?" for i in range(16)]
    results = asyncio.run(run_all(router, prompts, dataclasses.replace(GREEDY, max_tokens=24)))
    assert all(f == "length" for _, f in results)
    after = served(router, "decode")
    assert min(after[w] - before.get(w, 0) for w in after) >= 16 // 4, (before, after)


@pytest.mark.parametrize(("policy", "midway"), [("recompute", False), ("fail", False), ("recompute", True), ("fail", True)])
def test_failed_transfer_follows_policy(ray_local, engine_config, expected, policy, midway):
    """The first transfer fails at the sender: before its first part, or midway (its
    prompt is chunked: the first part went, the second failed, while the prompt computed).
    Either way the policy decides, the workers go on, and every block comes back."""
    transport = TransportConfig(timeout_s=3.0, failure_policy=policy, fail_transfer_ids=(0,), fail_midway=midway)
    router = deploy(engine_config, transport=transport)
    failing = 6  # its prompt is over two chunks of 32 tokens: its KV goes in several parts
    if policy == "recompute":
        tokens, _ = asyncio.run(collect(router, PROMPTS[failing]))
        assert tokens == expected[failing]
    else:
        with pytest.raises(Exception, match="KV transfer"):
            asyncio.run(collect(router, PROMPTS[failing]))
    # The workers keep serving, and the failed request's blocks are back.
    tokens, _ = asyncio.run(collect(router, PROMPTS[2]))
    assert tokens == expected[2]
    stats = router.worker_stats.remote().result()
    prefill, decode = next(iter(stats["prefill"].values()))["transport"], next(iter(stats["decode"].values()))["transport"]
    assert prefill["transfers_failed"] == decode["transfers_failed"] == 1 and prefill["transfers_ok"] == decode["transfers_ok"] == 1
    # A failed transfer counts no bytes received: midway, the part that went shows as bytes sent only.
    assert (prefill["bytes_sent"] > decode["bytes_received"]) == midway
    assert wait_until(lambda: all_blocks_returned(router))
