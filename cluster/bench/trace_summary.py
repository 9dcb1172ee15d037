"""What a trace replay came to (`pdserve bench trace`, and its simulation, `pdserve plan
--simulate`), per target:

    a request  meets the SLOs when its TTFT <= --slo-ttft-ms and its mean inter-token time
               (TPOT) <= --slo-itl-ms; attainment is the share that does, per phase and all
    cost       replica-seconds of both tiers, and core-seconds (replicas x their threads:
               what the budget counts; one 2-thread replica costs two cores)
    switches   each split the planner asked for, and how long until that many replicas
               ran (what a move costs: a replica's start, a drain)
    model      the planner's predicted over observed mean TTFT and ITL, median over each
               phase's second half (its steady part)
"""

from __future__ import annotations

import numpy as np

from cluster.bench.openai_client import RequestResult
from cluster.planner.workload import TraceRequest


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


def switches(asked: list[tuple[float, int, int]], running: list[tuple[float, int, int]]) -> list[dict]:
    """Each change of the split asked for: {"t", "to", "s"}, `s` the seconds until the
    running replicas matched it (None: asked for another split first, or never)."""
    out, last = [], None
    for i, (t, p, d) in enumerate(asked):
        if (p, d) == last:
            continue
        last = (p, d)
        superseded = next((u for u, *split in asked[i:] if tuple(split) != (p, d)), float("inf"))
        met = next((u for u, rp, rd in running if t <= u < superseded and (rp, rd) == (p, d)), None)
        out.append({"t": t, "to": f"{p}P{d}D", "s": None if met is None else met - t})
    return out


def predicted_over_observed(figures: list[dict], phases) -> dict:
    """Per phase: the median of predicted / observed TTFT and ITL over the phase's second
    half, from the planner's published figures (None where it published none)."""
    out = {}
    for name, start, end in phases:
        steady = [f for f in figures if (start + end) / 2 <= f["t"] < end]
        out[name] = {}
        for slo in ("ttft", "itl"):
            ratios = [f[f"predicted_{slo}_s"] / f[f"observed_{slo}_s"] for f in steady
                      if f.get(f"predicted_{slo}_s") and f.get(f"observed_{slo}_s")]
            out[name][slo] = float(np.median(ratios)) if ratios else None
    return out
