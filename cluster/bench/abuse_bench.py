"""`pdserve bench abuse`: what one abusive API key costs everyone else.

A light victim (one streamed request at a time, its own key) measures its TTFT alone and
beside an abuser (another key, in a process of its own), in alternating phases of equal
length, so that both sides of each ratio are measured in the same run. The abuser:

    fanout  loops /v1/completions of --fanout-prompts prompts x n=--fanout-n, one token each
    fuzz    sends requests generated from the server's own OpenAPI schema by schemathesis
            (valid and invalid, made before the phases start), malformed, oversized and
            out-of-range gRPC messages and Aborts of other ids, and opens streams (HTTP
            and gRPC) that it never reads, held until its phase ends

Reported: the victim's p50/p99 TTFT alone and abused, per round and over all; the
abuser's answers by status (`server_errors`: HTTP 5xx, gRPC INTERNAL/UNKNOWN); the worker
replicas before and after (a restarted one has a new id) and the KV blocks still in use
once the cluster is idle (a leak leaves some), both from /metrics; and the abuser's own CPU
time, which the server's two cores did not have.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing as mp
import random
import re
import socket
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import grpc
import httpx
import psutil

from cluster.bench.openai_client import send
from cluster.bench.provenance import write_result

VICTIM_PROMPT = "Summarize the plot of a short story about a fox in two sentences."
GRPC_BAD_CODES = ("INTERNAL", "UNKNOWN", "DATA_LOSS")


def run_abuse_bench(args) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"}
    model = args.model or httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    before = cluster_state(args.base_url, headers)
    ctx = mp.get_context("spawn")
    go, done, ready = ctx.Event(), ctx.Event(), ctx.Event()
    results = ctx.Queue()
    settings = {k: v for k, v in vars(args).items() if k != "fn"}  # (the command handler does not pickle)
    abuser = ctx.Process(target=_abuse, args=(args.mode, settings, model, go, done, ready, results), daemon=True)
    abuser.start()
    while not ready.wait(1.0):
        if not abuser.is_alive():
            raise RuntimeError("the abuser failed before its first phase (its error is above)")
    rounds = []
    for round_index in range(args.rounds):
        alone = asyncio.run(_victim(args, model, args.phase_s))
        go.set()
        abused = asyncio.run(_victim(args, model, args.phase_s))
        go.clear()
        rounds.append({"alone": alone, "abused": abused})
        print(f"round {round_index + 1}: victim p99 TTFT {_p(alone, 99):.1f} ms alone, {_p(abused, 99):.1f} ms abused", flush=True)
    done.set()
    abuse = results.get(timeout=120)
    abuser.join(60)
    idle_blocks = _wait_idle(args.base_url, headers)
    after = cluster_state(args.base_url, headers)
    summary = _summary(args, model, rounds, abuse, before, after, idle_blocks)
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))
    if args.result_dir:
        out = Path(args.result_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"abuse-{args.mode}"
        write_result(stem.with_suffix(".json"), summary)
        _plot(summary, stem.with_suffix(".png"))
    return 0


# ---- the victim ----------------------------------------------------------------------------


async def _victim(args, model: str, phase_s: float) -> list[float]:
    """TTFTs (ms) of the victim's requests, one at a time, for `phase_s`."""
    ttfts = []
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {args.api_key}"}, timeout=timeout) as session:
        end = time.monotonic() + phase_s
        while time.monotonic() < end:
            result = await send(session, args.base_url + "/v1/completions", model, VICTIM_PROMPT, args.victim_max_tokens, True, 0)
            if not result.success:
                raise RuntimeError(f"a victim request failed ({result.error}: {result.detail})")
            ttfts.append(result.ttft * 1e3)
    return ttfts


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values or [0.0])[0]


# ---- the abuser (its own process) ----------------------------------------------------------


def _abuse(mode: str, args: dict, model: str, go, done, ready, results) -> None:
    """The abuser's process: `--abuser-threads` threads send while `go` is set; the fuzz
    abuser's never-read streams are opened at a phase's start and closed at its end."""
    cases = _fuzz_cases(args, model) if mode == "fuzz" else []
    cpu_before = sum(psutil.Process().cpu_times()[:2])  # the cases' making is not the abuse's cost
    ready.set()
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def count(what: str) -> None:
        with lock:
            counts[what] += 1

    def sender(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=args["base_url"], timeout=120, headers={"Authorization": f"Bearer {args['abuser_key']}"}) as http, \
                grpc.insecure_channel(args["grpc_target"], options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            while not done.is_set():
                if not go.wait(0.2):
                    continue
                if mode == "fanout":
                    body = {"model": model, "prompt": ["Hi"] * args["fanout_prompts"], "n": args["fanout_n"], "max_tokens": 1}
                    count(f"http_{http.post('/v1/completions', json=body).status_code}")
                elif rng.random() < 0.15:
                    count(_grpc_abuse(channel, args["abuser_key"], model, rng))
                else:
                    try:
                        count(f"http_{http.request(**rng.choice(cases)).status_code}")
                    except httpx.HTTPError as e:
                        count(f"client_{type(e).__name__}")

    threads = [threading.Thread(target=sender, args=(seed,), daemon=True) for seed in range(args["abuser_threads"])]
    for thread in threads:
        thread.start()
    held: list[_Held] = []  # the never-read streams of the current phase
    while not done.wait(0.2):
        if go.is_set() and mode == "fuzz" and not held:
            held = _never_read(args, model)
            counts["never_read_streams"] += len(held)
        elif not go.is_set() and held:
            for stream in held:
                stream.close()
            held.clear()
    for thread in threads:
        thread.join(120)
    results.put({"answers": dict(counts), "cpu_s": round(sum(psutil.Process().cpu_times()[:2]) - cpu_before, 1)})


def _fuzz_cases(args: dict, model: str) -> list[dict]:
    """httpx request kwargs generated by schemathesis from the server's OpenAPI schema: for
    every operation, valid and invalid requests (a valid one's model is the served one, its
    output kept short, as a client that means it would send)."""
    import hypothesis  # noqa: PLC0415 - schemathesis and hypothesis: only for this benchmark
    import schemathesis  # noqa: PLC0415
    from schemathesis.generation import GenerationMode  # noqa: PLC0415

    auth = {"Authorization": f"Bearer {args['abuser_key']}"}
    schema = schemathesis.openapi.from_url(args["base_url"] + "/openapi.json", headers=auth)
    cases: list[dict] = []

    def collector(operation, mode):
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        @hypothesis.settings(max_examples=args["fuzz_examples"], deadline=None, database=None, derandomize=True,
                             suppress_health_check=list(hypothesis.HealthCheck))
        def collect(case):
            if mode == GenerationMode.POSITIVE and isinstance(case.body, dict):
                case.body["model"] = model
                case.body["max_tokens"] = min(8, case.body.get("max_tokens") or 8)
                case.body.pop("max_completion_tokens", None)
                case.body["n"] = 1
            kwargs = case.as_transport_kwargs(base_url=args["base_url"], headers=auth)
            cases.append({k: v for k, v in kwargs.items() if k in ("method", "url", "headers", "params", "json", "content")})

        return collect

    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode == GenerationMode.NEGATIVE and len(operation.body) == 0:
                continue  # an operation without a body has no invalid input to make
            collector(operation, mode)()
    return cases


def _grpc_abuse(channel, key: str, model: str, rng: random.Random) -> str:
    """One bad gRPC call: garbage bytes, an oversized message, an out-of-range field, or an
    Abort of an id this key never ran. Returns its status code's name."""
    from protos.pdserve.v1 import generation_pb2 as pb  # noqa: PLC0415 - the gRPC part of the fuzz only

    metadata = (("authorization", f"Bearer {key}"),)
    kind = rng.randrange(4)
    try:
        if kind == 0:
            call = channel.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=None, response_deserializer=None)
            list(call(rng.randbytes(rng.randrange(1, 512)), metadata=metadata, timeout=60))
        elif kind == 1:  # over the server's message limit (its HTTP body limit, 4 MiB)
            call = channel.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=None, response_deserializer=None)
            list(call(_oversized(model), metadata=metadata, timeout=60))
        elif kind == 2:
            params = pb.SamplingParameters(max_tokens=rng.choice([0, 10**9]), temperature=rng.choice([-1.0, 1e9]))
            list(_stub(channel).Generate(pb.GenerateRequest(model=model, text="x", params=params), metadata=metadata, timeout=60))
        else:
            _stub(channel).Abort(pb.AbortRequest(request_id=f"someone-{rng.randrange(10**6)}"), metadata=metadata, timeout=60)
        return "grpc_OK"
    except grpc.RpcError as e:
        return f"grpc_{e.code().name}"


@functools.cache
def _oversized(model: str) -> bytes:
    """A GenerateRequest of 5 MiB, serialized once (made anew, it cost the abuser a second of CPU)."""
    from protos.pdserve.v1 import generation_pb2 as pb  # noqa: PLC0415 - the gRPC part of the fuzz only

    return pb.GenerateRequest(model=model, text="x" * (5 << 20)).SerializeToString()


def _stub(channel):
    from protos.pdserve.v1 import generation_pb2_grpc as pb_grpc  # noqa: PLC0415 - the gRPC part of the fuzz only

    return pb_grpc.GenerationStub(channel)


class _Held:
    """A stream opened and never read: a socket (HTTP) or a call never iterated (gRPC)."""

    def __init__(self, close):
        self.close = close


def _never_read(args: dict, model: str) -> list[_Held]:
    from protos.pdserve.v1 import generation_pb2 as pb  # noqa: PLC0415 - the gRPC part of the fuzz only

    url = urlsplit(args["base_url"])
    body = json.dumps({"model": model, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {args['abuser_key']}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()
    held = []
    for _ in range(args["never_read_http"]):
        sock = socket.create_connection((url.hostname, url.port or 80), timeout=30)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes block soon
        sock.sendall(request)
        held.append(_Held(sock.close))
    channel = grpc.insecure_channel(args["grpc_target"])
    stub = _stub(channel)
    calls = [stub.Generate(pb.GenerateRequest(model=model, text="Tell me a long story.",
                                              params=pb.SamplingParameters(max_tokens=400, ignore_eos=True)),
                           metadata=(("authorization", f"Bearer {args['abuser_key']}"),)) for _ in range(args["never_read_grpc"])]
    held += [_Held(call.cancel) for call in calls]
    held.append(_Held(channel.close))
    return held


# ---- the cluster, from /metrics ------------------------------------------------------------

_KV_USAGE = re.compile(r'^pdserve_kv_cache_usage_ratio\{replica="([^"]+)",tier="([^"]+)"\} (\S+)$', re.M)


def cluster_state(base_url: str, headers: dict) -> dict[str, float]:
    """{worker replica: KV blocks in use / all}, as the gateway's /metrics reports them."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
    return {f"{tier}/{replica}": float(value) for replica, tier, value in _KV_USAGE.findall(text)}


def _wait_idle(base_url: str, headers: dict, timeout_s: float = 120.0) -> float:
    """The KV usage left once every abandoned stream has ended (0: nothing leaked)."""
    end = time.monotonic() + timeout_s
    while True:
        used = sum(cluster_state(base_url, headers).values())
        if used == 0 or time.monotonic() > end:
            return used
        time.sleep(1.0)


def _summary(args, model: str, rounds: list[dict], abuse: dict, before: dict, after: dict, idle_blocks: float) -> dict:
    counts = abuse["answers"]
    alone = [t for r in rounds for t in r["alone"]]
    abused = [t for r in rounds for t in r["abused"]]
    server_errors = sum(n for k, n in counts.items()
                        if re.fullmatch(r"http_5\d\d", k) or k.removeprefix("grpc_") in GRPC_BAD_CODES)
    requests = sum(n for k, n in counts.items() if k.startswith(("http_", "grpc_")))
    return {
        "mode": args.mode,
        "model": model,
        "phase_s": args.phase_s,
        "victim": {
            "requests_alone": len(alone), "requests_abused": len(abused),
            "p50_ttft_ms_alone": _p(alone, 50), "p50_ttft_ms_abused": _p(abused, 50),
            "p99_ttft_ms_alone": _p(alone, 99), "p99_ttft_ms_abused": _p(abused, 99),
            "p99_ratio": _p(abused, 99) / _p(alone, 99),
            "p99_ratio_per_round": [_p(r["abused"], 99) / _p(r["alone"], 99) for r in rounds],
        },
        "abuser": {"requests": requests, "server_errors": server_errors, "answers": counts, "client_cpu_s": abuse["cpu_s"]},
        "worker_replicas_restarted": sorted(set(before) - set(after)),
        "kv_usage_left_when_idle": idle_blocks,
        "rounds": rounds,
    }


def _plot(summary: dict, path: Path) -> None:
    from cluster.bench.plots import plot_phases  # noqa: PLC0415 - matplotlib, only when saving

    plot_phases(summary, path)
