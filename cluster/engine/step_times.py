"""Durations as plain histogram counts, by label: a worker's stats carry them to the gateway,
which serves them as Prometheus histograms.

`StepTimes`: how long an engine's steps take, by kind (`pdserve_engine_step_seconds`):

    decode   only requests past their prompt (one token each): the ITL floor
    prompt   only prompt chunks
    mixed    both: what a joining prompt costs the decodes beside it
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # upper bounds; +Inf follows
KINDS = ("decode", "prompt", "mixed")


class Histograms:
    """One histogram per label, fixed buckets; observed from any thread."""

    def __init__(self, labels: Sequence[str], buckets: Sequence[float] = BUCKETS_S) -> None:
        self.labels, self.buckets = tuple(labels), tuple(buckets)
        self.counts = {label: [0] * (len(self.buckets) + 1) for label in self.labels}  # per bucket, not cumulative
        self.sums = dict.fromkeys(self.labels, 0.0)
        self._lock = threading.Lock()

    def observe_as(self, label: str, seconds: float) -> None:
        with self._lock:
            self.counts[label][bisect.bisect_left(self.buckets, seconds)] += 1
            self.sums[label] += seconds

    def snapshot(self) -> dict[str, dict]:
        """{label: {"buckets": cumulative counts per bucket bound and +Inf, "sum": seconds}}."""
        out = {}
        with self._lock:
            for label in self.labels:
                cumulative, total = [], 0
                for n in self.counts[label]:
                    total += n
                    cumulative.append(total)
                out[label] = {"buckets": cumulative, "sum": self.sums[label]}
        return out


class StepTimes(Histograms):
    def __init__(self) -> None:
        super().__init__(KINDS)

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        self.observe_as("mixed" if num_decode_tokens and num_prompt_tokens else "decode" if num_decode_tokens else "prompt", seconds)
