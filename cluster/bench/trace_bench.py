"""`pdserve bench trace`: a time-varying workload replayed against each target in turn, with
SLO attainment per phase, the tiers' replica counts over time and replica-seconds.

    workload   a JSONL trace (--trace: one {"t", "prompt_len", "output_len"[, "phase"]} per
               request, t in seconds from the start) or the built-in phased one: BUILTIN
               phases of --phase-s each, Poisson arrivals (a burstiness per phase)
    targets    local configurations (--targets: '<P>p<D>d@threads', '[N]colocated@threads')
               and `planner`: the SLO planner (pdserve serve --planner slo) within
               --planner-budget cores, its tiers starting at 1P1D
    results    per phase and all, attainment and replica- and core-seconds: trace_summary.py

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

import aiohttp
from ray import serve

from cluster.bench import datasets
from cluster.bench.openai_client import RequestResult, send
from cluster.bench.plots import plot_trace
from cluster.bench.provenance import write_result
from cluster.bench.sweep_compare import local_cluster, local_config, local_ray, local_target, summary_path
from cluster.bench.trace_summary import predicted_over_observed, summarize, switches
from cluster.config import APP_NAME, PlannerConfig
from cluster.host.cpu_features import cpu_summary
from cluster.kv.redis_client import connect_sync
from cluster.launch import planner
from cluster.launch.serve import on_this_machine
from cluster.model.builtin import builtin_model_path
from cluster.model.gguf_tokenizer import load_tokenizer
from cluster.planner.policy import STATUS_KEY
from cluster.planner.workload import TraceRequest, builtin_trace, load_trace
from cluster.serving.routing import TIER_DEPLOYMENTS

SAMPLE_S = 2.0
PLANNER_FIGURES = ("predicted_ttft_s", "observed_ttft_s", "predicted_itl_s", "observed_itl_s")


class ReplicaSampler:
    """Serve's running replicas per tier, every SAMPLE_S, on a thread of its own; with a
    Redis URL also the SLO planner's targets (the replicas it asked for) and its predicted and
    observed mean TTFT and ITL."""

    def __init__(self, redis_url: str | None = None) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (seconds from start, prefill, decode)
        self.targets: list[tuple[float, int, int]] = []  # (seconds from start, prefill, decode) asked for
        self.figures: list[dict] = []  # {"t", "predicted_ttft_s", "observed_ttft_s", ...} as the planner published them
        self._redis = connect_sync(redis_url, socket_timeout=1.0) if redis_url else None
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
                status = self._redis.get(STATUS_KEY.format(app=APP_NAME)) if self._redis else None
                if status:
                    status = json.loads(status)
                    asked = status["replicas"]
                    self.targets.append((self.samples[-1][0], asked["prefill"], asked["decode"]))
                    self.figures.append({"t": self.samples[-1][0], **{k: status.get(k) for k in PLANNER_FIGURES}})
            except Exception:  # noqa: BLE001 - a sample missed is a gap in the line, not a failed run
                pass
            self._stop.wait(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


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


@contextmanager
def planner_cluster(args):
    """The SLO planner's cluster on the local Ray: 1P1D to start, each replica a core of
    the --planner-budget."""
    config = local_config("1p1d@1", args, redis_url=args._redis.url)
    tier = dataclasses.replace(config.decode, num_cpus=1.0)
    config = dataclasses.replace(config, prefill=tier, decode=tier, planner=PlannerConfig(
        mode="slo", ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, max_decode=args.planner_budget,
        max_prefill=args.planner_budget - 1, budget=args.planner_budget, profile=args.planner_profile))
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
                sampler = ReplicaSampler(args._redis.url if target == "planner" else None)
                results = asyncio.run(replay(url, requests, prompts, args.request_timeout))
                sampler.stop()
            threads = 1 if target == "planner" else local_target(target).threads or args.torch_threads
            out["targets"][target] = s = summarize(requests, results, phases, sampler.samples, args, threads)
            if sampler.targets:
                s["asked"], s["switches"] = sampler.targets, switches(sampler.targets, sampler.samples)
                s["planner_figures"] = sampler.figures
                s["predicted_over_observed"] = predicted_over_observed(sampler.figures, phases)
                moves = [f"{w['to']} in {w['s']:.0f} s" if w["s"] is not None else f"{w['to']} superseded" for w in s["switches"]]
                print(f"    switches: {', '.join(moves) or 'none'}")
            line = ", ".join(f"{name} {p['attainment']:.0%}" for name, p in s["phases"].items() if p["attainment"] is not None)
            print(f"{target}: attainment {s['attainment']:.1%} ({line}); {s['replica_seconds']:.0f} replica-seconds, "
                  f"{s['core_seconds']:.0f} core-seconds")
    path = summary_path(args, "trace.json")
    write_result(path, out)
    plot = plot_trace(out, path.with_suffix(".png"))
    print(f"wrote {path} and {plot}")
    return 0
