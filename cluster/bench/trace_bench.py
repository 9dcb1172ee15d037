"""`pdserve bench trace`: a time-varying workload replayed against each target in turn, with
SLO attainment per phase, the tiers' replica counts over time and replica-seconds.

    workload   a JSONL trace (--trace: one {"t", "prompt_len", "output_len"[, "phase"]} per
               request, t in seconds from the start) or the built-in phased one: BUILTIN
               phases of --phase-s each, Poisson arrivals (a burstiness per phase)
    targets    local configurations (--targets: '<P>p<D>d@threads', '[N]colocated@threads')
               and `planner`: the SLO planner (pdserve serve --planner slo) within
               --planner-budget cores, its tiers starting at 1P1D
    a request  meets the SLOs when its TTFT <= --slo-ttft-ms and its mean inter-token time
               (TPOT) <= --slo-itl-ms; attainment is the share that does, per phase and all
    cost       replica-seconds of both tiers, and core-seconds (replicas x their threads:
               what the budget counts; one 2-thread replica costs two cores)

The replica counts are Serve's running replicas per tier, sampled every SAMPLE_S. Writes
trace.json (per target: every request's timing, the samples, attainment, replica-seconds)
and trace.png (load, replica counts and attainment on one time axis).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp
import numpy as np
from ray import serve

from cluster.bench import datasets
from cluster.bench.openai_client import RequestResult, send
from cluster.bench.plots import plot_trace
from cluster.bench.provenance import write_result
from cluster.bench.sweep_compare import local_cluster, local_config, local_ray, local_target, summary_path
from cluster.config import APP_NAME, PlannerConfig
from cluster.host.cpu_features import cpu_summary
from cluster.launch import planner
from cluster.launch.serve import on_this_machine
from cluster.model.builtin import builtin_model_path
from cluster.model.gguf_tokenizer import load_tokenizer
from cluster.serving.routing import TIER_DEPLOYMENTS

SAMPLE_S = 2.0


@dataclass(frozen=True)
class Phase:
    name: str
    share: float  # of --phase-s
    rate: float  # requests/s
    prompt_len: int
    output_len: int
    burstiness: float = 1.0  # gamma shape of the gaps: < 1 is burstier than Poisson


# Chat, then prompt-heavy (long documents, short answers), then decode-heavy (short
# questions, long answers) in bursts, then quiet: each wants another split.
BUILTIN = (
    Phase("chat", 1.0, 0.5, 256, 64),
    Phase("long prompts", 1.0, 0.12, 1536, 16),
    Phase("long answers", 1.0, 0.3, 48, 256, burstiness=0.5),
    Phase("quiet", 1.0, 0.05, 256, 64),
)


@dataclass(frozen=True)
class TraceRequest:
    t: float
    phase: str
    prompt_len: int
    output_len: int


def builtin_trace(phase_s: float, seed: int) -> tuple[list[TraceRequest], list[tuple[str, float, float]]]:
    """(requests, phases as (name, start, end))."""
    rng = np.random.default_rng(seed)
    requests, phases, start = [], [], 0.0
    for p in BUILTIN:
        end = start + p.share * phase_s
        t = start
        while True:
            t += rng.gamma(shape=p.burstiness, scale=1.0 / (p.rate * p.burstiness))
            if t >= end:
                break
            requests.append(TraceRequest(t, p.name, p.prompt_len, p.output_len))
        phases.append((p.name, start, end))
        start = end
    return requests, phases


def load_trace(path: str) -> tuple[list[TraceRequest], list[tuple[str, float, float]]]:
    requests = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                requests.append(TraceRequest(float(d["t"]), str(d.get("phase", "all")), int(d["prompt_len"]), int(d["output_len"])))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: a trace line needs t, prompt_len and output_len ({e})") from None
    if not requests:
        raise ValueError(f"{path}: no request in the trace")
    requests.sort(key=lambda r: r.t)
    phases: dict[str, list[float]] = {}
    for r in requests:
        span = phases.setdefault(r.phase, [r.t, r.t])
        span[1] = r.t
    return requests, [(name, lo, hi) for name, (lo, hi) in phases.items()]


class ReplicaSampler:
    """Serve's running replicas per tier, every SAMPLE_S, on a thread of its own."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (seconds from start, prefill, decode)
        self._stop = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                deployments = serve.status().applications[APP_NAME].deployments
                counts = [deployments[TIER_DEPLOYMENTS[t]].replica_states.get("RUNNING", 0)
                          if TIER_DEPLOYMENTS[t] in deployments else 0 for t in ("prefill", "decode")]
                self.samples.append((time.perf_counter() - self._start, *counts))
            except Exception:  # noqa: BLE001 - a sample missed is a gap in the line, not a failed run
                pass
            self._stop.wait(SAMPLE_S)

    def stop(self) -> list[tuple[float, int, int]]:
        self._stop.set()
        self._thread.join()
        return self.samples


async def replay(url: str, requests: list[TraceRequest], prompts: list[str], timeout_s: float) -> list[RequestResult]:
    """Send each request at its time (an absolute schedule), streaming; results in order."""
    session = aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                    connector=aiohttp.TCPConnector(limit=0))
    async with session as client:
        start = time.perf_counter()

        async def one(r: TraceRequest, prompt: str) -> RequestResult:
            wait = start + r.t - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            return await send(client, "/v1/completions", "bench", prompt, r.output_len, True, r.prompt_len)

        return await asyncio.gather(*(one(r, p) for r, p in zip(requests, prompts)))


def meets(r: RequestResult, output_len: int, ttft_s: float, itl_s: float) -> bool:
    if not r.success:
        return False
    tpot = (r.latency - r.ttft) / (output_len - 1) if output_len > 1 else 0.0
    return r.ttft <= ttft_s and tpot <= itl_s


def replica_seconds(samples: list[tuple[float, int, int]], end_s: float) -> float:
    """Prefill + decode replicas integrated over [0, end_s] (each sample holds until the next)."""
    total = 0.0
    for (t, p, d), nxt in zip(samples, [*samples[1:], (end_s, 0, 0)]):
        total += (p + d) * max(0.0, min(nxt[0], end_s) - t)
    return total


def summarize(requests: list[TraceRequest], results: list[RequestResult], phases, samples, args, threads: int = 1) -> dict:
    """`threads`: each replica's torch threads (cores), for core-seconds."""
    slo_ttft, slo_itl = args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3
    ok = [meets(res, req.output_len, slo_ttft, slo_itl) for req, res in zip(requests, results)]
    t0 = min((res.start for res in results), default=0.0)
    per_phase = {}
    for name, _, _ in phases:
        idx = [i for i, r in enumerate(requests) if r.phase == name]
        done = [results[i] for i in idx if results[i].success]
        per_phase[name] = {
            "requests": len(idx), "failed": len(idx) - len(done),
            "attainment": sum(ok[i] for i in idx) / len(idx) if idx else None,
            "median_ttft_ms": float(np.median([r.ttft for r in done]) * 1e3) if done else None,
            "median_tpot_ms": float(np.median([(results[i].latency - results[i].ttft) / max(requests[i].output_len - 1, 1)
                                               for i in idx if results[i].success]) * 1e3) if done else None,
        }
    end_s = max(phases[-1][2], max((res.start - t0 + res.latency for res in results), default=0.0))
    spent = replica_seconds(samples, end_s)
    return {
        "attainment": sum(ok) / len(ok) if ok else None,
        "phases": per_phase,
        "replica_seconds": spent,
        "core_seconds": threads * spent,
        "replicas": samples,
        "requests": [{"t": req.t, "phase": req.phase, "ok": k, "success": res.success, "ttft_ms": res.ttft * 1e3,
                      "latency_ms": res.latency * 1e3} for req, res, k in zip(requests, results, ok)],
    }


@contextmanager
def planner_cluster(args):
    """The SLO planner's cluster on the local Ray: 1P1D to start, each replica a core of
    the --planner-budget."""
    config = local_config("1p1d@1", args, redis_url=args._redis.url)
    tier = dataclasses.replace(config.decode, num_cpus=1.0)
    config = dataclasses.replace(config, prefill=tier, decode=tier, planner=PlannerConfig(
        mode="slo", ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, max_decode=args.planner_budget,
        max_prefill=args.planner_budget - 1, budget=args.planner_budget))
    planner.deploy(on_this_machine(planner.planned(config)), local=True)
    try:
        yield f"http://127.0.0.1:{args._http_port}"
    finally:
        serve.delete(APP_NAME)


def run_trace_bench(args) -> int:
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    for t in targets:
        if t != "planner" and local_target(t) is None:
            raise ValueError(f"target {t!r}: 'planner' or a local configuration ('1p1d@1', '2colocated@1', 'colocated@2')")
    args.local_model = args.local_model or str(builtin_model_path())
    requests, phases = load_trace(args.trace) if args.trace else builtin_trace(args.phase_s, args.seed)
    tokenizer = load_tokenizer(args.local_model)
    rng = random.Random(args.seed)
    prompts = [datasets.random_text(rng, tokenizer, r.prompt_len) for r in requests]
    print(f"trace: {len(requests)} requests over {phases[-1][2]:.0f} s in {len(phases)} phases; targets {', '.join(targets)}")
    out = {"cpu": cpu_summary(), "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms,
           "phases": phases, "arrivals": [r.t for r in requests], "targets": {}}
    with local_ray(args, specs=[t for t in targets if t != "planner"]):
        for target in targets:
            cluster = planner_cluster(args) if target == "planner" else local_cluster(target, args)
            with cluster as url:
                sampler = ReplicaSampler()
                results = asyncio.run(replay(url, requests, prompts, args.request_timeout))
                samples = sampler.stop()
            threads = 1 if target == "planner" else local_target(target).threads or args.torch_threads
            out["targets"][target] = s = summarize(requests, results, phases, samples, args, threads)
            line = ", ".join(f"{name} {p['attainment']:.0%}" for name, p in s["phases"].items() if p["attainment"] is not None)
            print(f"{target}: attainment {s['attainment']:.1%} ({line}); {s['replica_seconds']:.0f} replica-seconds, "
                  f"{s['core_seconds']:.0f} core-seconds")
    path = summary_path(args, "trace.json")
    write_result(path, out)
    plot = plot_trace(out, path.with_suffix(".png"))
    print(f"wrote {path} and {plot}")
    return 0
