"""`pdserve plan`: the split of the tiers a workload needs, from a replica profile
(`pdserve bench profile`), without a cluster.

    steady load   (--rate, --prompt-len, --output-len) every split within the bounds and
                  budget with the planner's predicted mean TTFT and ITL
                  (cluster/planner/sizing.py), and the split the planner would choose
    --simulate    each target (`planner`: the SLO planner within the bounds and budget;
                  '<P>p<D>d' and '<N>colocated': fixed splits) against the discrete-event
                  model of the cluster (cluster/planner/simulate.py) over a trace (--trace,
                  or the built-in phases, or --day: 24 phases of --phase-s, rates scaled by
                  --rate-scale): what `pdserve bench trace` reports of a real run, in
                  seconds, at any size. --compare-with a `bench trace` result of the same
                  trace puts the simulated TTFT/TPOT percentiles beside the measured ones
                  per phase (the model's validation).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from cluster.bench.openai_client import RequestResult
from cluster.bench.plots import plot_trace
from cluster.bench.provenance import write_result
from cluster.bench.trace_summary import summarize
from cluster.launch.planner import HORIZON_S
from cluster.planner.policy import SloPlanner
from cluster.planner.profile import Profile
from cluster.planner.simulate import Simulation
from cluster.planner.sizing import Bounds, Load, Slo, Split, choose, predict
from cluster.planner.workload import BUILTIN, builtin_trace, day_phases, load_trace

TIERS = {"prefill": "prefill", "decode": "decode"}  # the planner's tier -> deployment names, simulated
MEASURED_NAMES = {"1p1d": "1p1d@1", "2colocated": "2colocated@1"}  # `bench trace`'s names of one-thread targets
PERCENTILES = (50, 90, 99)


def bounds_of(args) -> Bounds:
    return Bounds(args.prefill_min_replicas, args.prefill_max_replicas, args.decode_min_replicas,
                  args.decode_max_replicas, args.budget if args.budget is not None
                  else args.prefill_max_replicas + args.decode_max_replicas)


def steady(args, profile: Profile) -> dict:
    slo, bounds = Slo(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3), bounds_of(args)
    load = Load(args.rate, args.prompt_len, args.output_len)
    predictions = {s: predict(s, load, profile.prefill, profile.decode, profile.decode_step_slowdown) for s in bounds.splits()}
    if not predictions:
        raise ValueError("no split fits the bounds and the budget")
    chosen = choose(predictions, slo, bounds)
    print(f"{'split':>8} {'cost':>6} {'TTFT ms':>10} {'ITL ms':>8}")
    for s, p in predictions.items():
        print(f"{s!s:>8} {bounds.cost(s):6g} {_ms(p.ttft_s):>10} {_ms(p.itl_s):>8}{'   <- chosen' if s == chosen else ''}")
    return {"load": vars(load), "chosen": str(chosen),
            "predicted": {str(s): {"ttft_s": _finite(p.ttft_s), "itl_s": _finite(p.itl_s)} for s, p in predictions.items()}}


def parse_target(target: str) -> tuple[Split | None, bool]:
    """(fixed split or None for the planner, whether its engines are colocated ones)."""
    if target == "planner":
        return None, False
    if m := re.fullmatch(r"(\d+)p(\d+)d", target):
        return Split(int(m[1]), int(m[2])), False
    if m := re.fullmatch(r"(\d*)colocated", target):
        return Split(0, int(m[1] or 1)), True
    raise ValueError(f"target {target!r}: 'planner', '<P>p<D>d' (e.g. 1p1d, 0p2d) or '<N>colocated'")


def simulate(args, profile: Profile, target: str, requests) -> tuple[list[RequestResult], list, list]:
    split, colocated = parse_target(target)
    if split is not None:
        sim = Simulation(profile, requests, split, colocated=colocated)
    else:
        bounds = bounds_of(args)
        start = Split(min(max(1, bounds.min_prefill), bounds.max_prefill), bounds.min_decode)
        sim = Simulation(profile, requests, start)
        sim.planner = SloPlanner(
            ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, bounds=vars(bounds), tiers=TIERS,
            step_slowdown=profile.decode_step_slowdown, interval_s=args.planner_interval_s, downscale_s=args.planner_downscale_s,
            horizon_s=max(HORIZON_S, profile.replica_start_s), clock=lambda: sim.now)
    result = sim.run()
    results = [RequestResult(success=r.finish is not None and r.finish - r.arrival <= args.request_timeout, start=r.arrival,
                             ttft=(r.first_token or math.inf) - r.arrival, latency=(r.finish or math.inf) - r.arrival)
               for r in result.requests]
    return results, result.samples, result.decisions


def percentiles(requests, results: list[RequestResult], phases) -> dict:
    """Per phase: TTFT and TPOT (ms) at PERCENTILES, over the requests that succeeded."""
    out = {}
    for name, _, _ in phases:
        done = [(q, r) for q, r in zip(requests, results) if q.phase == name and r.success]
        if not done:
            continue
        ttft = [1e3 * r.ttft for _, r in done]
        tpot = [1e3 * (r.latency - r.ttft) / (q.output_len - 1) for q, r in done if q.output_len > 1]
        out[name] = {f"ttft_p{p}_ms": float(np.percentile(ttft, p)) for p in PERCENTILES}
        if tpot:
            out[name].update({f"tpot_p{p}_ms": float(np.percentile(tpot, p)) for p in PERCENTILES})
    return out


def measured_results(measured: dict, target: str) -> list[RequestResult] | None:
    name = MEASURED_NAMES.get(target, target)
    rows = measured["targets"].get(name)
    if rows is None:
        return None
    return [RequestResult(success=r["success"], start=r["t"], ttft=r["ttft_ms"] / 1e3, latency=r["latency_ms"] / 1e3)
            for r in rows["requests"]]


def compare(simulated: dict, measured: dict) -> dict:
    """Per phase and figure: simulated / measured."""
    out = {}
    for phase, figures in simulated.items():
        other = measured.get(phase, {})
        out[phase] = {k: v / other[k] for k, v in figures.items() if other.get(k)}
    return out


def run_plan(args) -> int:
    profile = Profile.load(args.profile)
    if not args.simulate:
        out = steady(args, profile)
        if args.result_dir:
            path = Path(args.result_dir) / "plan.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_result(path, out)
        return 0
    if args.trace:
        requests, phases = load_trace(args.trace)
    else:
        requests, phases = builtin_trace(args.phase_s, args.seed, day_phases(args.day) if args.day else BUILTIN,
                                         args.rate_scale)
    measured = json.loads(Path(args.compare_with).read_text()) if args.compare_with else None
    if measured is not None and not np.allclose(measured["arrivals"], [r.t for r in requests]):
        raise ValueError(f"{args.compare_with} was measured on another trace (give the same --phase-s and --seed, or --trace)")
    print(f"trace: {len(requests)} requests over {phases[-1][2]:.0f} s in {len(phases)} phases; profile {args.profile}")
    out = {"cpu": f"simulated from a profile measured on {profile.source.get('cpu', 'an unknown CPU')}",
           "profile": args.profile, "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms, "phases": phases,
           "arrivals": [r.t for r in requests], "targets": {}}
    for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
        results, samples, decisions = simulate(args, profile, target, requests)
        s = out["targets"][target] = summarize(requests, results, phases, samples, args)
        s["decisions"] = decisions
        s["percentiles"] = percentiles(requests, results, phases)
        print(f"{target}: attainment {s['attainment']:.1%}; {s['replica_seconds']:.0f} replica-seconds; "
              f"{len(decisions)} moves")
        if measured is not None and (observed := measured_results(measured, target)) is not None:
            s["measured_percentiles"] = percentiles(requests, observed, phases)
            s["simulated_over_measured"] = ratios = compare(s["percentiles"], s["measured_percentiles"])
            for phase, r in ratios.items():
                print(f"    {phase}: simulated/measured " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r.items()))
    path = Path(args.result_dir) / (args.result_filename or "plan-simulated.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, out)
    plot = plot_trace(out, path.with_suffix(".png"))
    print(f"wrote {path} and {plot}")
    return 0


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}" if math.isfinite(seconds) else "inf"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
