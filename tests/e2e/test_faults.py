"""Worker faults that clients never see: real SIGKILLs of replica processes while the
`openai` SDK streams from them. Every stream ends with the text an undisturbed run
gives (greedy: no repeated or missing token), the faults are counted, and every block
on the surviving workers returns."""

import json
import os
import re
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from cluster.config import RoutingConfig, TransportConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from tests.e2e.conftest import API_KEY, MODEL_NAME
from tests.helpers import all_blocks_returned, metric, wait_until

MAX_TOKENS = 160


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def greedy_texts(engine_config):
    """Undisturbed greedy texts from a local engine (so no worker caches these prompts
    before they are killed under them)."""
    engine = Engine(engine_config)
    return lambda prompts, n=MAX_TOKENS: [c.text for c in engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0))]


class Streams:
    """Greedy streams in client threads; `progress[i]` counts the chunks stream i has received."""

    def __init__(self, client, prompts, max_tokens=MAX_TOKENS):
        self.progress = [0] * len(prompts)
        self._pool = ThreadPoolExecutor(len(prompts))
        self._futures = [self._pool.submit(self._stream, client, i, p, max_tokens) for i, p in enumerate(prompts)]

    def _stream(self, client, i, prompt, max_tokens) -> str:
        text = ""
        for chunk in client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
        ):
            text += chunk.choices[0].text
            self.progress[i] += 1
        return text

    def ended(self) -> bool:
        """Whether every stream is over, a failed one too (texts() then raises its error)."""
        return all(f.done() for f in self._futures)

    def texts(self) -> list[str]:
        try:
            return [f.result(timeout=180) for f in self._futures]
        finally:
            self._pool.shutdown()


def worker_stats(live, tier: str) -> list[dict]:
    return list(live.handle.worker_stats.remote().result()[tier].values())


def counter(live, name: str) -> float:
    return metric(live.scrape(), name)


def carries_figures_of(scrape: str, worker_id: str) -> bool:
    """Whether a /metrics scrape heard from the worker (its KV cache gauge is there)."""
    return re.search(rf'^pdserve_kv_cache_usage_ratio\{{[^}}]*replica="{worker_id}"', scrape, re.M) is not None


def test_streams_go_on_when_their_decode_replica_is_killed(live, client, wide_model_config):
    """The wide model's streams outlast the stats call that picks the victim (the tiny
    one's 320 tokens could all end before it came back: nothing left to kill)."""
    live.redeploy(decodes=2, engine=wide_model_config)
    prompts = [f"Request {i}: tell me about the fox number {i} and its friends" for i in range(8)]
    long = 200
    expected = greedy_texts(wide_model_config)(prompts, long)
    before = counter(live, "pdserve_request_migrations_total")

    streams = Streams(client, prompts, long)
    assert wait_until(lambda: min(streams.progress) >= 3, timeout_s=60, interval_s=0.02)
    decodes = worker_stats(live, "decode")
    victim = max(decodes, key=lambda s: s["running"])
    assert victim["running"] > 0
    os.kill(victim["pid"], signal.SIGKILL)
    scrape = live.scrape()  # before Serve has noticed

    assert streams.texts() == expected  # every stream whole: none broken, no token twice or missing
    # The dead replica only goes silent: the scrape still carries the other's figures.
    (other,) = [s["worker_id"] for s in decodes if s["worker_id"] != victim["worker_id"]]
    assert carries_figures_of(scrape, other)
    assert counter(live, "pdserve_request_migrations_total") - before >= 1
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=90)


@pytest.mark.parametrize(("policy", "prefills"), [("recompute", 1), ("retry", 2)])
def test_prompts_survive_their_prefill_replica_being_killed(live, client, wide_model_config, policy, prefills):
    """A prefill replica dies while it computes long prompts: the decode worker computes
    them itself (recompute, the default) or asks the other prefill replica (retry)."""
    live.redeploy(
        decodes=1,
        prefills=prefills,
        transport=TransportConfig(timeout_s=10.0, failure_policy=policy),
        # Every prompt to the prefill tier (the decode worker computes none to help its
        # queue): the stats calls below must see that work under way before it ends.
        routing=RoutingConfig(max_local_prefill_tokens=0),
        engine=wide_model_config,
    )
    # The gateway learns of a new replica from Serve a little after the redeploy returns: until
    # then its stats leave that replica out, and the one seen busy may not be the one working.
    assert wait_until(lambda: len(worker_stats(live, "prefill")) == prefills, 60, 0.2)
    # Prompts of their own (no cache anywhere holds them), long (440 tokens of max_model_len's
    # 512), so the prefill replica has real work to die in.
    prompts = [f"Long prompt {i} under {policy}: " + "the fox runs over the hill and back again " * 20 for i in range(6)]
    expected = greedy_texts(wide_model_config)(prompts, 16)  # (the fault is in the prefill: a short decode will do)
    streams = Streams(client, prompts, 16)
    busy, polls = [], []  # polls: (seconds the stats call took, [(running, waiting)] per prefill replica)

    def seen_busy() -> bool:
        start = time.monotonic()
        stats = worker_stats(live, "prefill")
        polls.append((round(time.monotonic() - start, 2), [(s["running"], s["waiting"]) for s in stats]))
        busy.extend(s for s in stats if s["running"] + s["waiting"])
        return bool(busy)

    assert wait_until(lambda: seen_busy() or streams.ended(), 60, 0.05)
    assert busy, f"no prefill replica seen busy before the streams ended ({streams.texts()}); stats calls: {polls}"
    os.kill(busy[0]["pid"], signal.SIGKILL)

    assert streams.texts() == expected
    decode = worker_stats(live, "decode")
    assert sum(s["prefill_faults"] + s["recomputed"] for s in decode) >= 1
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=90)


def test_a_client_gone_during_the_hand_off_frees_blocks_on_both_tiers(live, wide_model_config):
    """The client disconnects while its prompt is on the prefill replica and the decode
    replica holds blocks reserved for its KV: both tiers abort it and free every block."""
    live.redeploy(engine=wide_model_config)
    aborted = lambda: {t: sum(s["finished"].get("abort", 0) for s in ws.values())  # noqa: E731
                       for t, ws in live.handle.worker_stats.remote().result().items()}
    before = aborted()
    body = json.dumps({"model": MODEL_NAME, "prompt": "Gone during the hand-off: " + "the fox runs over the hill and back again " * 20,
                       "max_tokens": 16, "stream": True})
    host, port = live.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:  # a raw client, to hang up at a moment of our choosing
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        assert wait_until(lambda: any(s["running"] + s["waiting"] for s in worker_stats(live, "prefill")), 60, 0.05)
        assert sum(s["used_blocks"] for s in worker_stats(live, "decode")) > 0  # its reservation, waiting for the KV
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=60)
    after = aborted()
    assert after["prefill"] == before["prefill"] + 1 and after["decode"] == before["decode"] + 1


def test_streams_on_a_replica_removed_by_scale_down_finish_elsewhere(live, client, wide_model_config):
    """Scale-down with no drain time: the removed replica's streams are handed to the
    one that stays (a longer drain_timeout_s lets them finish where they are). The wide
    model's streams outlast the redeploy; the tiny one's could end before Serve stopped
    the replica, and then nothing was left to hand over."""
    live.redeploy(decodes=2, drain_timeout_s=0.0, engine=wide_model_config)
    prompts = [f"Scale-down {i}: the fox and its {i} friends went" for i in range(8)]
    expected = greedy_texts(wide_model_config)(prompts, 200)
    before = counter(live, "pdserve_request_migrations_total")
    streams = Streams(client, prompts, 200)  # ~60 tokens in when the redeploy returns
    assert wait_until(lambda: min(streams.progress) >= 3, timeout_s=60, interval_s=0.02)
    live.redeploy(decodes=1, drain_timeout_s=0.0, engine=wide_model_config)

    assert streams.texts() == expected
    assert counter(live, "pdserve_request_migrations_total") - before >= 1
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=90)


def test_streams_of_a_hung_decode_replica_move_on_after_the_stall_timeout(live, client, wide_model_config):
    """SIGSTOP freezes a decode replica (a hung worker: alive to Ray, silent to its
    streams): after stall_timeout_s its streams continue on the other replica; once it
    wakes up it aborts what it held. The wide model's streams outlast the stats call that
    picks the victim; the tiny one's could end before the SIGSTOP landed, leaving nothing
    to stall."""
    live.redeploy(decodes=2, routing=RoutingConfig(stall_timeout_s=2.0), engine=wide_model_config)
    prompts = [f"Hang {i}: the fox number {i} sat down and" for i in range(8)]
    expected = greedy_texts(wide_model_config)(prompts, 200)
    before = metric(live.scrape(), "pdserve_request_migrations_total", reason="stalled")
    streams = Streams(client, prompts, 200)
    assert wait_until(lambda: min(streams.progress) >= 3, timeout_s=60, interval_s=0.02)
    decodes = worker_stats(live, "decode")
    victim = max(decodes, key=lambda s: s["running"])
    assert victim["running"] > 0
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        # While it hangs: as the stall is found, and after its streams moved (when it looks the least loaded).
        scrapes = [live.scrape()]
        texts = streams.texts()
        scrapes.append(live.scrape())
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    assert texts == expected
    # Each scrape counts the hung replica as silent and still carries the other's figures.
    (other,) = [s["worker_id"] for s in decodes if s["worker_id"] != victim["worker_id"]]
    for scrape in scrapes:
        assert metric(scrape, "pdserve_workers_silent", tier="decode") == 1
        assert metric(scrape, "pdserve_workers_silent", tier="prefill") == 0
        assert carries_figures_of(scrape, other)
    after = metric(live.scrape(), "pdserve_request_migrations_total", reason="stalled")
    assert after - before >= 1
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=90)
