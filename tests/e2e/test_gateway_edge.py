"""The gateway's edge on a real local cluster: API keys on every route, 404/413 in
OpenAI's shape, liveness/readiness, Prometheus metrics, admission limits that refuse
fast with Retry-After, and per-key rate limits shared through a real redis-server."""

import asyncio
import os
import re

import httpx
import ray
from ray._private import ray_constants

from cluster.config import LOCAL_SERVE_ENVIRONMENT, GatewayConfig, TransportConfig
from cluster.kv import redis_client
from cluster.launch.redis_server import PrivateRedis
from tests.e2e.conftest import API_KEY, MODEL_NAME
from tests.helpers import metric, wait_until

PUBLIC = {"/health"}


def completion(max_tokens=4, **kw):
    return {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


def test_every_route_refuses_a_missing_or_wrong_key(live, auth):
    schema = httpx.get(live.http_url + "/openapi.json", headers=auth).json()
    routes = [(method.upper(), path) for path, item in schema["paths"].items() for method in item]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route")]
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/ready")} <= set(routes)
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic " + API_KEY}):
            response = httpx.request(method, live.http_url + path, headers=headers, json=completion())
            if path in PUBLIC:
                assert response.status_code == 200
            else:
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"]["type"] == "authentication_error"
                assert API_KEY not in response.text


def test_unknown_route_and_oversized_body(live, auth):
    response = httpx.get(live.http_url + "/v1/nothing", headers=auth)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    huge = completion(prompt="x" * (4 * 1024 * 1024 + 1))
    response = httpx.post(live.http_url + "/v1/completions", headers=auth, json=huge)
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]

    def chunked():  # no Content-Length: the gateway counts what it reads
        yield b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "'
        for _ in range(5):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    response = httpx.post(live.http_url + "/v1/completions", headers={**auth, "content-type": "application/json"}, content=chunked())
    assert response.status_code == 413


def test_health_ready_and_metrics(live, auth):
    assert httpx.get(live.http_url + "/health").json() == {"status": "ok", "detail": None}
    assert httpx.get(live.http_url + "/ready", headers=auth, timeout=60).status_code == 200
    for _ in range(3):
        assert httpx.post(live.http_url + "/v1/completions", headers=auth, json=completion(6), timeout=60).status_code == 200
    response = httpx.get(live.http_url + "/metrics", headers=auth)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert metric(text, "pdserve_requests_total", status="ok", finish_reason="length") >= 4  # 3 + the readiness probe
    assert metric(text, "pdserve_time_to_first_token_seconds_count") >= 4
    assert metric(text, "pdserve_inter_token_latency_seconds_count") >= 3 * 5
    assert metric(text, "pdserve_e2e_request_latency_seconds_count") >= 4
    assert metric(text, "pdserve_kv_transfer_bytes_total") > 0 and metric(text, "pdserve_kv_transfer_seconds_count") >= 4
    # Prefill ran prompt-only steps, decode ran decode-only ones (>= 4 per request after its first token).
    assert metric(text, "pdserve_engine_step_seconds_count", tier="prefill", kind="prompt") >= 4
    assert metric(text, "pdserve_engine_step_seconds_count", tier="decode", kind="decode") >= 4
    for tier in ("prefill", "decode"):
        assert re.search(rf'pdserve_kv_cache_usage_ratio\{{replica="{tier}-\w+",tier="{tier}"\}} 0', text)
        assert re.search(rf'pdserve_requests_running\{{tier="{tier}"\}} 0', text)
        assert re.search(rf'pdserve_requests_waiting\{{tier="{tier}"\}} 0', text)


def test_engine_replicas_run_at_normal_priority(live):
    """Not at Ray's default worker niceness (15), where any other process on the host
    would take their cores first (cluster/config.py: RAY_SYSTEM_CONFIG)."""
    stats = live.handle.worker_stats.remote().result()
    pids = [s["pid"] for tier in ("prefill", "decode") for s in stats[tier].values()]
    assert pids and {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {0}


def _proc(pid: int, name: str) -> list[str]:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return [part.decode() for part in f.read().split(b"\0") if part]


def test_the_local_serve_controller_reconciles_less_often(live):
    """Every 0.25 s, not Serve's 0.1 s, unless the user set an interval (cluster/config.py:
    LOCAL_SERVE_ENVIRONMENT)."""
    (raylet,) = ray._private.worker.global_worker.node.all_processes[ray_constants.PROCESS_TYPE_RAYLET]
    environments = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if _proc(int(pid), "cmdline")[:1] == ["ray::ServeController"]:
                environments.append(dict(kv.split("=", 1) for kv in _proc(int(pid), "environ") if "=" in kv))
        except OSError:  # a process that ended while listed
            continue
    (controller,) = [env for env in environments if env.get("RAY_RAYLET_PID") == str(raylet.process.pid)]
    key = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    assert controller[key] == os.environ.get(key, LOCAL_SERVE_ENVIRONMENT[key])


def test_ready_is_503_when_the_kv_transfer_path_is_broken(live, auth):
    # Every KV transfer fails and the policy is `fail`: no token can get through
    # prefill -> transfer -> decode, so the cluster is not ready, though alive. /ready tells
    # the last real check, made at most every ready_interval_s: a probe sees it change.
    live.redeploy(GatewayConfig(api_keys=(API_KEY,), ready_interval_s=1.0),
                  transport=TransportConfig(timeout_s=10.0, failure_policy="fail", fail_every_nth=1))
    seen = {}

    def ready_status(want: int) -> bool:
        seen["response"] = httpx.get(live.http_url + "/ready", headers=auth, timeout=60)
        return seen["response"].status_code == want

    try:
        assert wait_until(lambda: ready_status(503), timeout_s=90, interval_s=0.5)
        assert seen["response"].json()["status"] == "unavailable"
        assert httpx.get(live.http_url + "/health").status_code == 200
        failed = httpx.post(live.http_url + "/v1/completions", headers=auth, json=completion(), timeout=60)
        assert failed.status_code == 503 and "Traceback" not in failed.text
    finally:
        live.redeploy(GatewayConfig(api_keys=(API_KEY,), ready_interval_s=1.0))
    assert wait_until(lambda: ready_status(200), timeout_s=90, interval_s=0.5)
    live.redeploy()


def test_ready_costs_nothing_per_call(live, auth):
    """Fifty /ready calls make at most two real checks (the interval is 10 s: one, and one
    more if they straddle its end); each check is one request through every tier."""
    assert httpx.get(live.http_url + "/ready", headers=auth, timeout=60).status_code == 200
    before = metric(live.scrape(), "pdserve_requests_total")
    for _ in range(50):
        assert httpx.get(live.http_url + "/ready", headers=auth, timeout=60).status_code == 200
    assert metric(live.scrape(), "pdserve_requests_total") - before <= 2


async def _admission_run(live, auth):
    """The first request streams on the wide model, as long as the context allows, and holds
    the running slot until the client closes it (which aborts it): its first token says it
    runs. The checks need a few gauge reads (~0.2 s); the stream would last ~4 s (measured;
    the tiny model's 480 tokens took 0.36 s, and a 240-token request on it once ended before
    the last check)."""
    async with httpx.AsyncClient(base_url=live.http_url, headers=auth, timeout=120) as client:

        async def gauge(name):
            return metric((await client.get("/metrics")).text, name)

        async with client.stream("POST", "/v1/completions", json=completion(max_tokens=480, stream=True)) as first:
            lines = first.aiter_lines()
            while not (await anext(lines)).startswith("data: "):  # its first token: it holds the running slot ...
                pass
            second = asyncio.create_task(client.post("/v1/completions", json=completion()))
            for _ in range(300):  # ... and the second waits in the queue
                if await gauge("pdserve_gateway_requests_queued") == 1:
                    break
                await asyncio.sleep(0.05)
            # refused at once, not after waiting for a slot (that would take queue_timeout_s: 600 s)
            rejected = await asyncio.wait_for(
                asyncio.gather(*(client.post("/v1/completions", json=completion()) for _ in range(8))), 60
            )
            still_running = await gauge("pdserve_gateway_requests_running")
            first_status = first.status_code
        return first_status, await second, rejected, still_running  # (the first closed and aborted: the second ran)


def test_admission_limits_refuse_fast_with_retry_after(live, auth, wide_model_config):
    gateway = GatewayConfig(api_keys=(API_KEY,), max_running_requests=1, max_queued_requests=1, retry_after_s=2,
                            queue_timeout_s=600)
    live.redeploy(engine=wide_model_config, gateway=gateway)
    try:
        first_status, second, rejected, still_running = asyncio.run(_admission_run(live, auth))
        assert first_status == second.status_code == 200
        assert [r.status_code for r in rejected] == [503] * 8
        assert all(r.headers["retry-after"] == "2" for r in rejected)
        assert all(r.json()["error"]["type"] == "overloaded_error" for r in rejected)
        assert still_running == 1  # every refusal came back while the first request still ran
    finally:
        live.redeploy()


def test_rate_limit_per_key_is_shared_through_redis(live, auth):
    other_key = "sk-other-key"
    with PrivateRedis() as limiter_redis:
        live.redeploy(
            # A token comes back every 1000 s: none within the test, however slow the machine.
            GatewayConfig(api_keys=(API_KEY, other_key), rate_limit_rps=0.001, rate_limit_burst=2),
            redis_url=limiter_redis.url,
            gateways=2,
        )
        try:
            codes = [httpx.post(live.http_url + "/v1/completions", headers=auth, json=completion(1)) for _ in range(5)]
            assert [r.status_code for r in codes] == [200, 200, 429, 429, 429]  # burst 2, whichever gateway replica
            assert int(codes[2].headers["retry-after"]) >= 1 and codes[2].json()["error"]["type"] == "rate_limit_error"
            other = httpx.post(live.http_url + "/v1/completions", headers={"Authorization": f"Bearer {other_key}"}, json=completion(1))
            assert other.status_code == 200  # each key has its own bucket
            client = redis_client.connect_sync(limiter_redis.url)
            assert len(client.keys("pdserve:ratelimit:*")) == 2  # one bucket per key (the index shares this Redis)
            stored = b"".join(client.keys("*")) + b"".join(client.dump(k) or b"" for k in client.keys("pdserve:ratelimit:*"))
            assert API_KEY.encode() not in stored and other_key.encode() not in stored  # never the key itself
            limiter_redis.stop()  # Redis gone: requests go through, and the failure is counted

            def passes_and_is_counted():  # by whichever gateway replica served it, which counts its own
                assert httpx.post(live.http_url + "/v1/completions", headers=auth, json=completion(1)).status_code == 200
                # Two scrapes: the ingress may alternate replicas, and the scrape after a request
                # would then always land on the other one.
                scrapes = [live.scrape() for _ in range(2)]
                return max(metric(text, "pdserve_rate_limit_errors_total") for text in scrapes) >= 1

            assert wait_until(passes_and_is_counted)
        finally:
            live.redeploy()
