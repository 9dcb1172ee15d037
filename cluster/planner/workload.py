"""A time-varying workload: requests at their times with their prompt and output lengths,
grouped in named phases. Replayed against a cluster (`pdserve bench trace`) or against the
planner's model of one (`pdserve plan --simulate`).

    a JSONL trace   one {"t", "prompt_len", "output_len"[, "phase"]} per request, t in
                    seconds from the start (`load_trace`)
    built-in        BUILTIN's phases of `phase_s` each, gamma-distributed gaps (Poisson at
                    burstiness 1, burstier below) (`builtin_trace`)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np


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
    Phase("long prompts", 1.0, 0.2, 768, 16),
    Phase("long answers", 1.0, 0.3, 48, 256, burstiness=0.5),
    Phase("quiet", 1.0, 0.05, 256, 64),
)


@dataclass(frozen=True)
class TraceRequest:
    t: float
    phase: str
    prompt_len: int
    output_len: int


def day_phases(peak_rate: float) -> tuple[Phase, ...]:
    """A day in 24 phases of an hour each: the rate follows the sun (a tenth of the peak at
    4 am, the peak at 4 pm), and so does the mix: chat by day, long answers (agents,
    code) in the evening, long prompts (batch summarization) at night."""
    phases = []
    for hour in range(24):
        rate = peak_rate * (0.1 + 0.9 * (1 - math.cos(2 * math.pi * (hour - 4) / 24)) / 2)
        if 8 <= hour < 18:
            phases.append(Phase(f"{hour:02d}h chat", 1.0, rate, 512, 128))
        elif 18 <= hour < 23:
            phases.append(Phase(f"{hour:02d}h long answers", 1.0, rate, 128, 512, burstiness=0.5))
        else:
            phases.append(Phase(f"{hour:02d}h long prompts", 1.0, rate, 2048, 64))
    return tuple(phases)


def builtin_trace(phase_s: float, seed: int, phases: tuple[Phase, ...] = BUILTIN,
                  rate_scale: float = 1.0) -> tuple[list[TraceRequest], list[tuple[str, float, float]]]:
    """(requests, phases as (name, start, end)): `phases` of `phase_s` each (times their
    share), every rate times `rate_scale`."""
    rng = np.random.default_rng(seed)
    requests, spans, start = [], [], 0.0
    for p in phases:
        end = start + p.share * phase_s
        t, rate = start, p.rate * rate_scale
        while True:
            t += rng.gamma(shape=p.burstiness, scale=1.0 / (rate * p.burstiness))
            if t >= end:
                break
            requests.append(TraceRequest(t, p.name, p.prompt_len, p.output_len))
        spans.append((p.name, start, end))
        start = end
    return requests, spans


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
