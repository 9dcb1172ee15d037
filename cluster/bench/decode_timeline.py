"""Where the decode tier's slow steps come from: its engines' step timelines
(cluster/engine/step_timeline.py), read through Serve from a local target's workers, and
each slow step's excess time put down to its cause.

A decode step's interval (between_s + step_s: what one token of every running request
waits, on the engine's side) is slow when it exceeds SLOW_FACTOR x the median interval of
the decode-only steps of the same batch size measured alone. Its excess over that median goes to

    prompt_work     the step carried prompt tokens (a prompt computed beside the decodes)
    outside_steps   the engine thread's work between steps (commits, adds, calls, outputs)
    waited          time the engine thread was off its core inside the step (step_s - cpu_s:
                    another process or thread on the core, the GIL)
    compute         the rest: the step computed longer on its core (a bigger batch, a longer
                    context, a slower core)

in that order, each taking at most what is left of the excess.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from ray import serve

from cluster.config import APP_NAME
from cluster.serving.routing import TIER_DEPLOYMENTS, RouteHint, replica_of

SLOW_FACTOR = 1.2  # the decode-protection goal: a step over 1.2x its alone median slows every decode
CAUSES = ("prompt_work", "outside_steps", "waited", "compute")
TIMELINE_CALL_S = 60.0


def decode_timelines(since: float) -> dict[str, list[dict]]:
    """{worker id: steps (dicts of StepRecord's fields) begun since wall-clock `since`} of every
    decode worker of the local app (the caller is connected to its Ray)."""
    gateway = serve.get_app_handle(APP_NAME)
    decode = serve.get_deployment_handle(TIER_DEPLOYMENTS["decode"], APP_NAME)
    workers = gateway.live_workers.remote().result(timeout_s=TIMELINE_CALL_S).get("decode", [])
    out = {}
    for worker in workers:
        reply = decode.step_timeline.remote(RouteHint(replica=replica_of(worker)), since).result(timeout_s=TIMELINE_CALL_S)
        out[reply["worker_id"]] = [dict(zip(reply["fields"], row)) for row in reply["steps"]]
    return out


def _interval(step: dict) -> float:
    return step["between_s"] + step["step_s"]


def alone_medians(timelines: dict[str, list[dict]]) -> dict[int, float]:
    """{batch size: median interval of the decode-only steps of that size}, over every worker."""
    by_size = defaultdict(list)
    for steps in timelines.values():
        for s in steps:
            if s["decode"] and not s["prompt"]:
                by_size[s["decode"]].append(_interval(s))
    return {n: statistics.median(v) for n, v in by_size.items()}


def _baseline(medians: dict[int, float], size: int) -> float | None:
    """The alone median of the nearest batch size at or below `size` (a bigger batch beside
    a joining request is its own cost, not a stall), else the smallest measured."""
    if not medians:
        return None
    below = [n for n in medians if n <= size]
    return medians[max(below)] if below else medians[min(medians)]


def attribute(timelines: dict[str, list[dict]], medians: dict[int, float]) -> dict:
    """The decode steps' slow ones and their excess seconds by cause (module docstring)."""
    steps = [s for line in timelines.values() for s in line if s["decode"]]
    excess = dict.fromkeys(CAUSES, 0.0)
    slow = dict.fromkeys(CAUSES, 0)  # slow steps by their largest cause
    for s in steps:
        base = _baseline(medians, s["decode"])
        if base is None or _interval(s) <= SLOW_FACTOR * base:
            continue
        left = _interval(s) - base
        parts = {}
        for cause, seconds in (("prompt_work", left if s["prompt"] else 0.0), ("outside_steps", s["between_s"]),
                               ("waited", max(0.0, s["step_s"] - s["cpu_s"])), ("compute", left)):
            parts[cause] = min(left, seconds)
            left -= parts[cause]
        for cause, seconds in parts.items():
            excess[cause] += seconds
        slow[max(parts, key=parts.get)] += 1
    intervals = sorted(_interval(s) for s in steps)
    return {
        "decode_steps": len(steps),
        "slow_steps": sum(slow.values()),
        "slow_steps_by_cause": slow,
        "excess_s_by_cause": excess,
        "p99_interval_ms": 1000 * intervals[min(len(intervals) - 1, int(0.99 * len(intervals)))] if intervals else None,
    }
