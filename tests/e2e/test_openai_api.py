"""The official `openai` SDK, unchanged, against a real local cluster (1 prefill +
1 decode worker, KV over gloo): completions and chat, streamed and not, equal the
offline engine token for token; usage, finish reasons, n, logprobs, errors."""

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.text.tokenizer import Tokenizer
from tests.e2e.conftest import API_KEY, MODEL_NAME
from tests.helpers import all_blocks_returned, wait_until

SHARED = "You are a helpful assistant. Answer briefly and precisely, citing sources. "
PROMPTS = ["Hi", SHARED + "What is the capital of France?", "Numbers: " + " ".join(str(i) for i in range(30))]
MESSAGES = [
    {"role": "system", "content": SHARED},
    {"role": "user", "content": "Tell me about foxes."},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline(engine_config):
    return Engine(engine_config)


@pytest.fixture(scope="module")
def tokenizer(engine_config):
    return Tokenizer.from_pretrained(engine_config.model)


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_models_lists_the_served_name(client):
    (model,) = client.models.list().data
    assert model.id == MODEL_NAME and model.owned_by == "pdserve"


def test_completions_equal_the_offline_engine(client, offline):
    expected = offline.generate(PROMPTS, greedy())
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        (choice,) = got.choices
        assert choice.text == want.text and choice.finish_reason == "length"
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == MAX_TOKENS
        assert got.model == MODEL_NAME and got.id.startswith("cmpl-")


def test_streamed_completion_equals_the_offline_engine_and_reports_usage(client, offline):
    (want,) = offline.generate([PROMPTS[1]], greedy())
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == want.text
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_token_id_prompts_and_prompt_lists(client, offline, tokenizer):
    ids = tokenizer.encode(PROMPTS[2])
    expected = offline.generate([ids, PROMPTS[0]], greedy())
    got = client.completions.create(
        model=MODEL_NAME, prompt=[ids], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].text == expected[0].text
    both = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPTS[2], PROMPTS[0]], max_tokens=MAX_TOKENS, temperature=0, n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [expected[0].text] * 2 + [expected[1].text] * 2  # greedy: choices agree
    assert both.usage.prompt_tokens == len(expected[0].prompt_token_ids) + len(expected[1].prompt_token_ids)
    assert both.usage.completion_tokens == 4 * MAX_TOKENS


def test_chat_equals_the_offline_engine_streamed_and_not(client, offline, tokenizer):
    (want,) = offline.generate([tokenizer.encode_chat(MESSAGES)], greedy())
    got = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == "length" and got.usage.completion_tokens == MAX_TOKENS
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)

    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(want.prompt_token_ids) + MAX_TOKENS


def test_sampling_parameters_reach_the_engine(client, offline):
    params = dict(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                  repetition_penalty=1.1, seed=7, min_tokens=3)
    (want,) = offline.generate([PROMPTS[1]], SamplingParams(max_tokens=MAX_TOKENS, **params))
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=params["temperature"], top_p=params["top_p"],
        presence_penalty=params["presence_penalty"], frequency_penalty=params["frequency_penalty"], seed=params["seed"],
        extra_body={k: params[k] for k in ("top_k", "min_p", "repetition_penalty", "min_tokens")},
    )
    assert got.choices[0].text == want.text  # seeded sampling is reproducible across the cluster


def test_stop_strings_and_stop_token_ids(client, offline):
    (free,) = offline.generate([PROMPTS[0]], greedy(24))
    stop_id = free.token_ids[5]
    (want,) = offline.generate([PROMPTS[0]], greedy(24, stop_token_ids=(stop_id,)))
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}
    )
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == want.text
    stop = free.text[len(free.text) // 2 :][:3]
    if stop:
        (want,) = offline.generate([PROMPTS[0]], greedy(24, stop=(stop,)))
        got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text and stop not in got.choices[0].text


def test_logprobs_in_completions_and_chat(client, offline, tokenizer):
    (want,) = offline.generate([PROMPTS[0]], greedy(4, logprobs=3))
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in want.logprobs], abs=1e-4)
    assert all(len(top) <= 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"unknown_field": 1}, "unknown_field"),
        ({"max_tokens": 10_000}, "prompt"),  # prompt + max_tokens over the context length
        ({"min_tokens": 20, "max_tokens": 5}, None),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], [10**9]]}, "prompt"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(live, auth, body, param):
    response = httpx.post(live.http_url + "/v1/completions", headers=auth, json={"model": MODEL_NAME, "prompt": "hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_sdk_raises_its_own_error_types(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi")
    assert "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)


def test_sse_stream_ends_with_done_and_bad_input_costs_nothing(live, auth):
    before = live.handle.worker_stats.remote().result()
    with httpx.stream(
        "POST", live.http_url + "/v1/completions", headers=auth, timeout=60,
        json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "stream": True},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
    for _ in range(5):
        assert httpx.post(live.http_url + "/v1/completions", headers=auth,
                          json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 10**6, "stream": True}).status_code == 400
    after = live.handle.worker_stats.remote().result()
    # The refused requests never reached a worker: the decode tier finished only the first.
    (b,), (a,) = before["decode"].values(), after["decode"].values()
    assert sum(a["finished"].values()) - sum(b["finished"].values()) == 1


def test_client_disconnect_mid_stream_frees_every_block_on_both_tiers(live, auth):
    before = live.handle.worker_stats.remote().result()["decode"]
    (aborted_before,) = [s["finished"].get("abort", 0) for s in before.values()]
    with httpx.stream(
        "POST", live.http_url + "/v1/completions", headers=auth, timeout=60,
        json={"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "stream": True},
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [next(lines) for _ in range(4)]  # a few events arrive, then the client goes away
        assert any(line.startswith("data: {") for line in got)
    assert wait_until(lambda: all_blocks_returned(live.handle), timeout_s=30)
    after = live.handle.worker_stats.remote().result()["decode"]
    (aborted_after,) = [s["finished"].get("abort", 0) for s in after.values()]
    assert aborted_after == aborted_before + 1  # aborted, not run to its 480 tokens


def test_a_request_that_fans_out_too_far_is_refused_before_any_work(client, live):
    """Prompts per request, choices (prompts x n) and prompt tokens per request are bounded,
    each refused with a 400 that names its limit; nothing runs (no block is taken)."""
    cases = [
        (dict(prompt=["Hi"] * 33), "33 prompts in one request; the limit is 32 (max_prompts_per_request)"),
        (dict(prompt=["Hi"] * 5, n=16), "5 prompt(s) x n=16 is 80 choices; the limit is 64 (max_choices_per_request)"),
        (dict(prompt=[[5] * 400] * 32, max_tokens=1),
         "the request's prompts have 12800 tokens; the limit is 12000 (max_request_input_tokens)"),
    ]
    live.redeploy(live.gateway_config(max_request_input_tokens=12000))
    try:
        for kwargs, message in cases:
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=MODEL_NAME, **{"max_tokens": 4, **kwargs})
            assert e.value.body["message"] == message
        assert all_blocks_returned(live.handle)
        many = client.completions.create(model=MODEL_NAME, prompt=["Hi"] * 4, n=16, max_tokens=1)  # 64: at the limit
        assert len(many.choices) == 64
    finally:
        live.redeploy()


def test_the_grafana_dashboard_queries_only_series_the_server_exports(live, client):
    """deploy/grafana-dashboard.json: every series a panel's query names is one the gateway's
    /metrics exports (a family declared there), and every label it groups by is one that
    series carries (where it has samples: some counters have none until their event)."""
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    exported: dict[str, set[str]] = {}  # series name -> labels seen
    for family in text_string_to_metric_families(live.scrape()):
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"), "counter": ("_total",)}
        for suffix in suffixes.get(family.type, ("",)):
            exported.setdefault(family.name + suffix, set())
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 20
    for expr in exprs:
        series = re.findall(r"\bpdserve_[a-z0-9_]+", expr)
        for name in series:
            assert name in exported, (name, expr)
        for by in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in by.split(",")):
                for name in series:
                    assert not exported[name] or label in exported[name], (label, name, expr)
    topics = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("first token", "inter-token", "throughput", "queues", "kv cache", "hit rate", "transfer", "migrations", "replicas"):
        assert topic in topics
