"""Tensor-parallel replicas in a live cluster (CPU, gloo, real rank processes): P/D
between tiers of different TP sizes gives the `openai` SDK the single-device greedy
text, every rank moving its own KV heads; killing one rank of a decode replica moves its
streams to another replica, and Serve replaces the whole replica."""

import dataclasses
import os
import signal

import openai
import pytest

from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from tests.e2e.conftest import API_KEY, MODEL_NAME
from tests.e2e.test_faults import Streams, counter, worker_stats
from tests.helpers import all_blocks_returned, wait_until

PROMPTS = [f"Tensor parallel {i}: the fox and its friends walked over the hills to the river" for i in range(3)]


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def greedy(config, prompts, n=24) -> list[str]:
    return [c.text for c in Engine(config).generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))]


def transfers(stats: dict) -> list[int]:
    """transfers_ok of each rank's transport: rank 0 first."""
    return [stats["transport"].get("transfers_ok", 0), *(t.get("transfers_ok", 0) for t in stats["rank_transports"])]


# qwen2 (4 KV heads), 2 -> 1: the decode rank gets heads 0-1 from prefill rank 0 and 2-3
# from rank 1. mistral (1 KV head), 1 -> 2: both decode ranks hold the one head, each gets it.
@pytest.mark.parametrize(("variant", "prefill_tp", "decode_tp"), [("qwen2", 2, 1), ("mistral", 1, 2)])
def test_pd_between_tp_sizes_streams_the_single_device_greedy_text(live, client, tiny_models, variant, prefill_tp, decode_tp):
    config = dataclasses.replace(live.engine_config, model=str(tiny_models[variant]))
    expected = greedy(config, PROMPTS)
    live.redeploy(engine=config, prefill_tp=prefill_tp, decode_tp=decode_tp)
    prefill, decode = worker_stats(live, "prefill")[0], worker_stats(live, "decode")[0]
    assert len(prefill["ranks"]) == prefill_tp and len(decode["ranks"]) == decode_tp
    assert len({r["pid"] for r in prefill["ranks"] + decode["ranks"]}) == prefill_tp + decode_tp

    got = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=24, temperature=0.0).choices[0].text for p in PROMPTS]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0.0, stream=True)
    )
    assert got == expected and streamed == expected[0]

    prefill, decode = worker_stats(live, "prefill")[0], worker_stats(live, "decode")[0]
    assert decode["recomputed"] == 0  # the KV arrived: nothing was recomputed on decode
    # Every rank of both replicas moved pieces of every request's KV (none gathered through rank 0).
    assert all(n >= len(PROMPTS) for n in transfers(decode)), transfers(decode)
    assert all(n >= len(PROMPTS) for n in transfers(prefill)), transfers(prefill)
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=30)


def test_killing_one_rank_of_a_decode_replica_moves_its_streams(live, client, tiny_models):
    config = live.engine_config
    prompts = [f"Rank kill {i}: the fox number {i} sat down and" for i in range(4)]
    expected = greedy(config, prompts, 80)
    live.redeploy(engine=config, decodes=2, decode_tp=2)
    before = counter(live, "pdserve_request_migrations_total")

    streams = Streams(client, prompts, 80)
    assert wait_until(lambda: min(streams.progress) >= 3, timeout_s=60, interval_s=0.02)
    victim = max(worker_stats(live, "decode"), key=lambda s: s["running"])
    assert victim["running"] > 0
    os.kill(victim["ranks"][1]["pid"], signal.SIGKILL)  # rank 1: not the replica's own process

    assert streams.texts() == expected  # every stream whole: those of the victim moved to the other replica
    assert counter(live, "pdserve_request_migrations_total") - before >= 1
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=90)
    # Serve's health check replaces the broken replica with a whole new one (both ranks).
    assert wait_until(
        lambda: all(len({r["pid"] for r in s["ranks"]}) == 2 and victim["pid"] != s["pid"] for s in worker_stats(live, "decode")),
        timeout_s=90,
    )
