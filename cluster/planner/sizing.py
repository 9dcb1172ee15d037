"""Predicted TTFT and ITL of a split of the tiers, and the split that meets both SLOs.

A split is (prefill replicas P, decode replicas D). With P = 0 the decode replicas compute
every prompt themselves (the router places prompts there when the prefill tier has no
replica), as colocated engines do. Per replica, for a load of `rate` requests/s with
`prompt_tokens` computed per request and `output_tokens` each:

    prefill tier   S = prefill_s(prompt)              one prompt alone on the engine
                   rho = rate * S / P                 busy fraction
                   TTFT = S + rho * S / (2 (1 - rho)) M/D/1: the prompt plus its wait
    decode tier    x = rate * (output - 1) / D        tokens/s each replica must decode
                   N = x * step(N)                    Little's law: running requests
                   ITL = step(N) = a + b N       ->   N = x a / (1 - x b)
    colocated      the same engine also computes prompts, a share u = rate * S / D of its
                   time: decode steps get 1 - u of it (ITL = step(N) / (1 - u)), and a
                   prompt beside running decodes gets (s - 1) / s of each step (the step
                   budget's slowdown s), so it computes s / (s - 1) times slower while any
                   request decodes there: a share 1 - exp(-N) of the time (N decoding on
                   average, arriving at random); alone it takes whole steps

These are means of a steady state; the planner scales them by what it observes
(`Calibration`), so that the model need only rank the splits right.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.planner.costs import EngineCosts

INF = math.inf


@dataclass(frozen=True)
class Load:
    requests_per_s: float
    prompt_tokens: float  # computed per request (after prefix-cache hits)
    output_tokens: float  # generated per request


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True, order=True)
class Split:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    itl_s: float

    def scaled(self, ttft: float, itl: float) -> Prediction:
        return Prediction(self.ttft_s * ttft, self.itl_s * itl)

    def score(self, slo: Slo) -> float:
        """The worse of the two SLOs' ratios target / predicted: >= 1 meets both."""
        return min(_ratio(slo.ttft_s, self.ttft_s), _ratio(slo.itl_s, self.itl_s))


def _ratio(target: float, predicted: float) -> float:
    return INF if predicted <= 0 else target / predicted


def md1_wait(busy: float, service_s: float) -> float:
    """M/D/1 mean wait in queue; inf at or past saturation."""
    return INF if busy >= 1 else busy * service_s / (2 * (1 - busy))


def decode_itl(x: float, costs: EngineCosts, share: float = 1.0) -> float:
    """Mean inter-token time of a decode engine that must produce `x` tokens/s, with
    `share` of its time for decode steps."""
    a, b = costs.decode_base_s, costs.decode_per_seq_s
    if x <= 0:
        return a / share if share > 0 else INF
    if share <= x * b:
        return INF
    running = x * a / (share - x * b)
    return (a + b * running) / share


def predict(split: Split, load: Load, prefill: EngineCosts, decode: EngineCosts, step_slowdown: float) -> Prediction:
    """Mean TTFT and ITL of `split` under `load` (uncalibrated)."""
    if split.decode < 1:
        return Prediction(INF, INF)
    rate = max(load.requests_per_s, 0.0)
    decode_tokens = rate * max(load.output_tokens - 1, 0.0) / split.decode
    if split.prefill >= 1:
        service = prefill.prefill_s(load.prompt_tokens)
        ttft = service + md1_wait(rate * service / split.prefill, service)
        return Prediction(ttft, decode_itl(decode_tokens, decode))
    # Colocated: the decode replicas compute the prompts too.
    service = decode.prefill_s(load.prompt_tokens)
    prompt_share = rate * service / split.decode
    itl = decode_itl(decode_tokens, decode, share=1.0 - prompt_share)
    beside = 1.0 - math.exp(-decode_tokens * itl) if math.isfinite(itl) else 1.0  # some request decodes
    stretch = 1.0 + beside * (step_slowdown / (step_slowdown - 1) - 1.0) if step_slowdown > 1 else 1.0
    stretched = service * stretch
    ttft = stretched + md1_wait(rate * stretched / split.decode, stretched)
    return Prediction(ttft, itl)


@dataclass(frozen=True)
class Bounds:
    """Replicas per tier, and the budget they share: each replica costs its tier's
    resource units (cores on a CPU cluster, GPUs on a GPU one)."""

    min_prefill: int
    max_prefill: int
    min_decode: int
    max_decode: int
    budget: float
    prefill_units: float = 1.0
    decode_units: float = 1.0

    def cost(self, split: Split) -> float:
        return split.prefill * self.prefill_units + split.decode * self.decode_units

    def splits(self) -> list[Split]:
        """Every split within the bounds and the budget, cheapest first."""
        out = [Split(p, d) for p in range(self.min_prefill, self.max_prefill + 1)
               for d in range(max(1, self.min_decode), self.max_decode + 1)]
        return sorted((s for s in out if self.cost(s) <= self.budget + 1e-9), key=lambda s: (self.cost(s), s))


HEADROOM = 0.8  # a split meets an SLO when its predicted mean is within this share of it


def choose(predictions: dict[Split, Prediction], slo: Slo, bounds: Bounds) -> Split:
    """The cheapest split predicted to meet both SLOs with HEADROOM (the roomier one of
    equal cost); when none does, the budget binds: the best `Prediction.score` (cheaper
    first on a tie), or, when every split saturates, the largest."""
    meets = [s for s, p in predictions.items() if p.score(slo) >= 1 / HEADROOM]
    if meets:
        return min(meets, key=lambda s: (bounds.cost(s), -predictions[s].score(slo), s))
    best = max(p.score(slo) for p in predictions.values())
    if best == 0:
        return max(predictions, key=lambda s: (bounds.cost(s), s))
    return min(predictions, key=lambda s: (-predictions[s].score(slo), bounds.cost(s), s))
