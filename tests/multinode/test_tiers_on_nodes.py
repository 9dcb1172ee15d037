"""The e2e suite's core cases with the tiers on separate Ray nodes (tests/multinode/conftest.py):
the same greedy text as one engine alone, every KV transfer over TCP between the nodes
(none through shared memory, though they share a machine), KV-aware routing, a client's
cancellation, and a whole decode node killed mid-stream (its raylet and replicas at once):
every stream ends whole elsewhere, no block stays in use, the prefix index drops the dead
worker, and Serve puts its replacement on a new node."""

import random

import openai
import pytest

from cluster.kv import redis_client
from cluster.kv.prefix_index import worker_key
from tests.e2e.conftest import API_KEY, MODEL_NAME
from tests.e2e.test_faults import Streams, counter, greedy_texts, worker_stats
from tests.e2e.test_kv_routing import GREEDY
from tests.helpers import all_blocks_returned, wait_until

PROMPTS = [f"Request {i}: tell me about the fox number {i}, its den by the river and all of its many friends" for i in range(6)]


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def transport_totals(live) -> dict[str, dict[str, int]]:
    """Per tier, the KV transports' counters summed over its replicas."""
    keys = ("transfers_ok", "transfers_shared_memory", "bytes_sent", "bytes_received")
    return {tier: {k: sum(s["transport"][k] for s in worker_stats(live, tier)) for k in keys} for tier in ("prefill", "decode")}


def test_each_tier_runs_on_nodes_of_its_own(live, nodes):
    prefill, decode = worker_stats(live, "prefill"), worker_stats(live, "decode")
    assert {s["node_id"] for s in prefill} == {nodes.nodes["prefill-1"].node_id}
    assert sorted(s["node_id"] for s in decode) == sorted(nodes.nodes[n].node_id for n in ("decode-2", "decode-3"))
    assert nodes.head.node_id not in {s["node_id"] for s in prefill + decode}


def test_streams_match_one_engine_and_their_kv_crosses_nodes_over_tcp(live, client, engine_config):
    expected = greedy_texts(engine_config)(PROMPTS, 24)
    before = transport_totals(live)
    assert Streams(client, PROMPTS, 24).texts() == expected
    after = transport_totals(live)
    sent = {tier: {k: after[tier][k] - before[tier][k] for k in after[tier]} for tier in after}
    assert sent["prefill"]["transfers_ok"] == sent["decode"]["transfers_ok"] == len(PROMPTS), sent
    assert sent["prefill"]["bytes_sent"] == sent["decode"]["bytes_received"] > 0, sent
    # Never shared memory between two Ray nodes, though both map this machine's /dev/shm.
    assert after["prefill"]["transfers_shared_memory"] == after["decode"]["transfers_shared_memory"] == 0, after


def test_a_second_turn_lands_where_the_first_turns_kv_is_on_either_tier(live, engine_config):
    handle, rng = live.handle, random.Random(7)
    first_turn = [rng.randrange(10, 200) for _ in range(40)]
    reply = [t for o in handle.options(stream=True).generate.remote(first_turn, GREEDY) for t in o.new_token_ids]
    before = handle.worker_stats.remote().result()
    list(handle.options(stream=True).generate.remote(first_turn + reply + [rng.randrange(10, 200) for _ in range(12)], GREEDY))
    after = handle.worker_stats.remote().result()
    whole_blocks = 40 // engine_config.cache.block_size * engine_config.cache.block_size
    for tier in ("prefill", "decode"):
        gained = {w: after[tier][w]["prefix_hit_tokens"] - before[tier][w]["prefix_hit_tokens"] for w in after[tier]}
        assert max(gained.values()) >= whole_blocks, (tier, gained)  # the node holding the first turn took it


def test_a_cancelled_stream_frees_its_blocks_on_both_nodes(live, client):
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=400, temperature=0.0, stream=True)
    for _, _chunk in zip(range(3), stream):
        pass
    assert any(s["running"] for s in worker_stats(live, "decode"))
    stream.close()
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=30)


def test_a_decode_node_lost_mid_stream_loses_no_stream_and_leaks_nothing(live, client, nodes, engine_config):
    long = 200  # the streams outlast picking the victim
    reference = greedy_texts(engine_config)
    expected = reference(PROMPTS, long)
    migrations = counter(live, "pdserve_request_migrations_total")
    streams = Streams(client, PROMPTS, long)
    assert wait_until(lambda: min(streams.progress) >= 3, timeout_s=60, interval_s=0.02)
    victim = max(worker_stats(live, "decode"), key=lambda s: s["running"])
    assert victim["running"] > 0
    nodes.kill(nodes.by_id(victim["node_id"]).name)  # its raylet, and with it the replica

    assert streams.texts() == expected  # every stream whole: none broken, no token twice or missing
    assert counter(live, "pdserve_request_migrations_total") - migrations >= 1
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=60)  # on every surviving replica
    index = redis_client.connect_sync(live.redis.url)
    assert wait_until(lambda: not index.exists(worker_key(victim["worker_id"])), timeout_s=30)  # heartbeats stopped

    # A new node (what the autoscaler would add) takes the replacement replica.
    fresh = nodes.add_tier_node("decode")
    assert wait_until(lambda: fresh.node_id in {s["node_id"] for s in worker_stats(live, "decode")}, timeout_s=120)
    assert Streams(client, PROMPTS, 8).texts() == reference(PROMPTS, 8)
