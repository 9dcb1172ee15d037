"""`pdserve bench serve`: an online serving benchmark against any OpenAI-compatible
server, with `vllm bench serve`'s flags, counting and result keys.

Requests arrive at --request-rate (inf: all at once) with gamma-distributed gaps
(--burstiness 1.0 is Poisson) scaled so the last arrives at num_prompts / rate, at most
--max-concurrency in flight. Multi-turn
conversations send their turns one after another, each carrying the whole history.
Against pdserve it also scrapes /metrics before and after: prefix-cache hit rate per
tier, what the router predicted, and the KV bytes moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import time
from datetime import datetime
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from tqdm import tqdm

from cluster.bench import datasets
from cluster.bench.openai_client import RequestResult, send
from cluster.bench.plots import plot_serve_result
from cluster.bench.provenance import write_result
from cluster.model.builtin import BUILTIN_MODEL_NAME, builtin_model_path
from cluster.model.gguf_tokenizer import load_tokenizer
from cluster.text.tokenizer import Tokenizer

METRICS = ("ttft", "tpot", "itl", "e2el")


# ---- arrivals and sending --------------------------------------------------------------


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start: gaps drawn from
    gamma(shape=burstiness, mean=1/rate), then scaled so the last arrival is at exactly
    n/rate (as vllm bench serve does: runs with different seeds keep the same mean rate).
    All zero for an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist()


async def _run(
    args, model: str, work, tokenizer: Tokenizer, abort_after: list[int | None] | None = None, on_start=None,
    interference: list[RequestResult] | None = None,
) -> tuple[list[RequestResult], float, list[float]]:
    """Send the workload; (results, duration, arrival times relative to the start).
    Single-turn results are in the workload's order; `abort_after[i]` makes the client
    drop request i after that many chunks (see openai_client.send); `on_start()` is
    called as the first request goes (after the warm-ups); the --interference-* requests
    that ended before the workload did go to `interference`."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    response_format = None
    if args.json_schema:
        with open(args.json_schema) as f:
            response_format = {"type": "json_schema", "json_schema": {"name": "bench", "schema": json.load(f), "strict": True}}
    results: list[RequestResult] = []
    arrivals: list[float] = []
    multi_turn = args.dataset_name == "multi_turn"
    total = sum(len(c.user_turns) for c in work) if multi_turn else len(work)
    bar = tqdm(total=total, desc="requests", unit="req", disable=args.disable_tqdm)

    # aiohttp, as vllm bench serve uses: on a small machine the client's own CPU time per
    # streamed chunk is part of what is measured, so it must be as cheap as theirs.
    session = aiohttp.ClientSession(
        base_url=args.base_url.rstrip("/"),
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=args.request_timeout),
        connector=aiohttp.TCPConnector(limit=0),
    )
    async with session as client:

        async def one(prompt, prompt_len: int, output_len: int, abort: int | None = None) -> RequestResult:
            async with gate or contextlib.nullcontext():
                r = await send(client, args.endpoint, model, prompt, output_len, args.ignore_eos, prompt_len, abort, response_format)
            results.append(r)
            bar.update(1)
            return r

        async def conversation(conv: datasets.Conversation) -> None:
            history: list[dict] = []
            for user, output_len in zip(conv.user_turns, conv.output_lens):
                history.append({"role": "user", "content": user})
                r = await one(list(history), 0, output_len)
                if not r.success:
                    return  # a broken conversation does not go on
                history.append({"role": "assistant", "content": r.text})

        # Made before the load starts: tokenizing them takes longer than a short workload runs.
        long_prompts = datasets.interference_requests(args, tokenizer, count=64) if args.interference_rate > 0 else []
        for warm in list(work)[: args.num_warmups]:  # not measured
            if multi_turn:
                await send(client, args.endpoint, model, [{"role": "user", "content": warm.user_turns[0]}], 4, True, 0)
            else:
                await send(client, args.endpoint, model, warm.prompt, min(4, warm.output_len), True, warm.prompt_len)

        tasks = []
        if on_start is not None:
            on_start()
        start = time.perf_counter()
        interfering = None
        if long_prompts:
            interfering = asyncio.create_task(_interfere(client, args, model, long_prompts,
                                                         interference if interference is not None else []))
        aborts = abort_after or [None] * len(work)
        for item, at, abort in zip(work, arrival_times(len(work), args.request_rate, args.burstiness, args.seed), aborts):
            wait = start + at - time.perf_counter()  # absolute schedule: sleep overshoots do not add up
            if wait > 0:
                await asyncio.sleep(wait)
            arrivals.append(time.perf_counter() - start)
            coroutine = conversation(item) if multi_turn else one(item.prompt, item.prompt_len, item.output_len, abort)
            tasks.append(asyncio.create_task(coroutine))
        in_order = await asyncio.gather(*tasks)
        if not multi_turn:
            results = in_order
        duration = time.perf_counter() - start
        if interfering is not None:
            interfering.cancel()
            await asyncio.gather(interfering, return_exceptions=True)
    bar.close()
    return results, duration, arrivals


async def _interfere(client, args, model: str, prompts: list, ended: list[RequestResult]) -> None:
    """Until cancelled (when the measured workload is done): `prompts` in turn at
    --interference-rate, Poisson, each its own request; their results are not counted
    with the workload's, and those that end go to `ended`."""
    rng = np.random.default_rng(args.seed + 1)
    sent = []
    try:
        for i in itertools.count():
            await asyncio.sleep(rng.exponential(1.0 / args.interference_rate))
            p = prompts[i % len(prompts)]
            sent.append(asyncio.create_task(send(client, args.endpoint, model, p.prompt, p.output_len, True, p.prompt_len)))
            sent[-1].add_done_callback(lambda task: None if task.cancelled() or task.exception() else ended.append(task.result()))
    finally:
        for task in sent:
            task.cancel()


# ---- what the server's own metrics say ---------------------------------------------------


def scrape(base_url: str, api_key: str | None) -> dict[str, float] | None:
    """pdserve's /metrics as {series: value} (None for a server without one)."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30,
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text)


def scrape_settled(base_url: str, api_key: str | None, timeout_s: float = 60.0) -> dict[str, float] | None:
    """A scrape in which every worker answered (pdserve_workers_silent 0), within
    `timeout_s`: a worker in a long step (a prefill of thousands of tokens is one) answers
    its stats call only after it, and a scrape without its figures would count none of its
    work in the deltas. The last scrape if none settles."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(base_url, api_key)
        silent = sum(v for k, v in (metrics or {}).items() if k.startswith("pdserve_workers_silent"))
        if not silent or time.monotonic() > deadline:
            return metrics
        time.sleep(1.0)


def parse_metrics(text: str) -> dict[str, float]:
    """pdserve's series of a Prometheus text exposition: {name{labels}: value}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(pdserve_[a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values


def server_deltas(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None

    def total(prefix: str, label: str = "") -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix) and label in k)

    out = {"kv_transfer_bytes": total("pdserve_kv_transfer_bytes_total")}
    for tier in ("prefill", "decode"):
        query = total("pdserve_prefix_cache_query_tokens_total", f'tier="{tier}"')
        hit = total("pdserve_prefix_cache_hit_tokens_total", f'tier="{tier}"')
        predicted = total("pdserve_route_predicted_hit_tokens_total", f'tier="{tier}"')
        if query:
            out[f"{tier}_prefix_cache_hit_rate"] = hit / query
            out[f"{tier}_prefix_cache_hit_tokens"] = hit
            out[f"{tier}_route_predicted_hit_tokens"] = predicted
        # The engines' own decode-only steps (runner and sampler) over the run: beside the
        # client's TPOT, what the step took and what serving it added. (prometheus_client
        # writes a series' labels sorted by name.)
        decode_steps = f'kind="decode",tier="{tier}"'
        steps = total("pdserve_engine_step_seconds_count", decode_steps)
        if steps:
            out[f"{tier}_decode_step_mean_ms"] = 1e3 * total("pdserve_engine_step_seconds_sum", decode_steps) / steps
        out[f"{tier}_engine_busy_s"] = total("pdserve_engine_step_seconds_sum", f'tier="{tier}"')  # steps of every kind
    # Hand-offs (decode's `handoff` phase): a handed-off request's first token to its second.
    handoff = 'phase="handoff",tier="decode"'
    if handoffs := total("pdserve_request_phase_seconds_count", handoff):
        out["handoffs"] = handoffs
        out["handoff_mean_ms"] = 1e3 * total("pdserve_request_phase_seconds_sum", handoff) / handoffs
    out["route_fallbacks"] = total("pdserve_route_fallbacks_total")
    for key, value in after.items():  # and by reason, where any (router/placement.py's labels)
        reason = re.fullmatch(r'pdserve_route_fallbacks_total\{reason="([a-z_]+)"\}', key)
        if reason and value - before.get(key, 0.0):
            out[f"route_fallbacks_{reason.group(1)}"] = value - before.get(key, 0.0)
    out["request_migrations"] = total("pdserve_request_migrations_total")
    out["route_local_prefills"] = total("pdserve_route_local_prefills_total")  # prompts computed where they decode
    return out


# ---- counting ----------------------------------------------------------------------------


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def summarize(args, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) * 1e3 for r in ok if r.output_len > 1],
        "itl": [x * 1e3 for r in ok for x in r.itl],
        "e2el": [r.latency * 1e3 for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    out = {
        "completed": len(ok),
        "failed": sum(1 for r in results if not r.success and r.error != "aborted"),
        "aborted": sum(1 for r in results if r.error == "aborted"),  # by the client, on purpose
        "num_prompts": len(results),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    selected = args.percentile_metrics.split(",")
    for name in METRICS:
        data = values[name] or [0.0]
        out[f"mean_{name}_ms"] = float(np.mean(data))
        out[f"median_{name}_ms"] = float(np.median(data))
        out[f"std_{name}_ms"] = float(np.std(data))
        if name in selected:
            for p in percentiles:
                out[f"p{_p_word(p)}_{name}_ms"] = float(np.percentile(data, p))
    slo = goodput_slos(args.goodput)
    good = sum(1 for r in ok if meets(r, slo))
    out["request_goodput"] = good / duration if slo else None
    out["failure_breakdown"] = dict(sorted(_count(r.error for r in results if not r.success and r.error != "aborted").items()))
    out["num_empty_outputs"] = sum(r.empty_output for r in ok)  # succeeded without visible text
    out["errors"] = [f"{r.error}: {r.detail}" for r in results if not r.success and r.error != "aborted"][:20]
    out.update(_peaks(ok))
    out["output_throughput_over_time"] = throughput_over_time(ok, min((r.start for r in ok), default=0.0))
    out["input_lens"] = [r.prompt_len for r in ok]
    out["output_lens"] = [r.output_len for r in ok]
    out["ttfts"] = [r.ttft for r in ok]
    out["itls"] = [r.itl for r in ok]
    out["e2els"] = [r.latency for r in ok]
    out["generated_texts"] = [r.text for r in ok]
    return out


def goodput_slos(specs: list[str] | None) -> dict[str, float]:
    """`--goodput ttft:MS tpot:MS e2el:MS` as {metric: ms}."""
    slo = {}
    for spec in specs or ():
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        slo[name] = float(value)
    return slo


def meets(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.success:
        return False
    tpot = (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0
    measured = {"ttft": r.ttft * 1e3, "tpot": tpot * 1e3, "e2el": r.latency * 1e3}
    return all(measured[k] <= v for k, v in slo.items())


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def _peaks(ok: list[RequestResult]) -> dict:
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start for r in ok)
    per_second = throughput_over_time(ok, t0)
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return {"max_output_tokens_per_s": max(per_second, default=0.0), "max_concurrent_requests": peak}


def throughput_over_time(ok: list[RequestResult], t0: float) -> list[float]:
    """Output tokens per 1-second bin since t0 (a delta's tokens spread evenly over its request's deltas)."""
    bins: dict[int, float] = {}
    for r in ok:
        if r.token_times:
            per_delta = r.output_len / len(r.token_times)
            for t in r.token_times:
                bins[int(t - t0)] = bins.get(int(t - t0), 0.0) + per_delta
    return [bins.get(i, 0.0) for i in range(max(bins) + 1)] if bins else []


# ---- the command -------------------------------------------------------------------------


def resolve_model(args) -> str:
    """--model, else the first model the server lists. ConnectionError (a one-line CLI error)
    if the server cannot be asked: down, wrong URL, or an API key it refuses."""
    if args.model:
        return args.model
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.base_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ConnectionError(f"cannot list the models at {url} ({type(e).__name__}: {e}); is the server up? "
                              "(or pass --model)") from None


def run_once(args) -> dict:
    """One benchmark run; the result dict (vllm bench serve's keys, plus server metrics)."""
    return measure(args)[0]


def measure(args, abort_plan=None, on_start=None) -> tuple[dict, list, list[RequestResult]]:
    """One benchmark run: (the result dict, the workload, each request's result in the
    workload's order for single-turn datasets). `abort_plan(work)` gives, per request,
    after how many chunks the client drops it (None: never); `on_start()` is called as
    the load starts."""
    model = resolve_model(args)
    tokenizer_dir = args.tokenizer or (str(builtin_model_path()) if model == BUILTIN_MODEL_NAME else model)
    if not Path(tokenizer_dir).exists():
        raise ValueError(f"no model directory or .gguf file {tokenizer_dir!r} for the tokenizer: pass --tokenizer PATH")
    tokenizer = load_tokenizer(tokenizer_dir)
    work = datasets.load(args, tokenizer)
    before = scrape_settled(args.base_url, args.api_key)
    abort_after = abort_plan(work) if abort_plan else None
    interference: list[RequestResult] = []
    results, duration, arrivals = asyncio.run(_run(args, model, work, tokenizer, abort_after, on_start, interference))
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if args.endpoint.endswith("chat/completions") else "openai",
        "endpoint": args.endpoint,
        "base_url": args.base_url,
        "model_id": model,
        "tokenizer_id": tokenizer_dir,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **summarize(args, results, duration),
        "arrival_times": arrivals,
        "server_metrics": server_deltas(before, scrape_settled(args.base_url, args.api_key)),
    }
    if args.interference_rate > 0:
        result["interference"] = interference_summary(interference)
    for item in args.metadata or ():
        key, _, value = item.partition("=")
        result[key] = value
    return result, work, results


def interference_summary(ended: list[RequestResult]) -> dict:
    """The --interference-* prompts that ended during the run: their TTFTs, and the gaps
    between their first and second tokens (disaggregated, the first comes from the prefill
    side and the second waits for the hand-off: what decode protection must keep short)."""
    done = [r for r in ended if r.success]
    return {
        "completed": len(done),
        "failed": len(ended) - len(done),
        "ttfts_ms": [r.ttft * 1e3 for r in done],
        "first_to_second_token_ms": [r.itl[0] * 1e3 for r in done if r.itl],
    }


def print_summary(result: dict) -> None:
    rows = [
        ("Successful requests", result["completed"]),
        ("Failed requests", f"{result['failed']} {result['failure_breakdown'] or ''}"),
        ("Benchmark duration (s)", f"{result['duration']:.2f}"),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}"),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {title} --", ""))
        for key in sorted(k for k in result if k.endswith(f"_{name}_ms")):
            rows.append((f"{key.split('_')[0].capitalize()} {name.upper()} (ms)", f"{result[key]:.2f}"))
    server = result.get("server_metrics")
    if server:
        rows.append(("-- Server (pdserve /metrics) --", ""))
        rows += [(k, f"{v:.4g}") for k, v in server.items()]
    print("{s:=^60}".format(s=" Serving Benchmark Result "))
    for label, value in rows:
        print(f"{label:<44}{value!s:>16}" if value != "" else "{s:-^60}".format(s=label.strip("- ").join("  ")))
    print("=" * 60)


def result_path(args, result: dict) -> Path:
    if args.result_filename:
        name = args.result_filename
    else:
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", str(result["model_id"]).strip("/").split("/")[-1])
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = f"pdserve-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"
    return Path(args.result_dir or ".") / name


def run_serve_bench(args) -> int:
    result = run_once(args)
    print_summary(result)
    if args.save_result:
        path = result_path(args, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_result(path, result)
        print(f"wrote {path}")
        for plot in plot_serve_result(result, path.with_suffix("")):
            print(f"wrote {plot}")
    return 0 if result["completed"] else 1
