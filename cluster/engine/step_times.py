"""How long an engine's steps take, by kind, as plain histogram counts: a worker's stats
carry them to the gateway, which serves them as `pdserve_engine_step_seconds`.

    decode   only requests past their prompt (one token each): the ITL floor
    prompt   only prompt chunks
    mixed    both: what a joining prompt costs the decodes beside it
"""

from __future__ import annotations

import bisect

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)  # upper bounds; +Inf follows
KINDS = ("decode", "prompt", "mixed")


class StepTimes:
    def __init__(self) -> None:
        self.counts = {kind: [0] * (len(BUCKETS_S) + 1) for kind in KINDS}  # per bucket, not cumulative
        self.sums = dict.fromkeys(KINDS, 0.0)

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        kind = "mixed" if num_decode_tokens and num_prompt_tokens else "decode" if num_decode_tokens else "prompt"
        self.counts[kind][bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sums[kind] += seconds

    def snapshot(self) -> dict[str, dict]:
        """{kind: {"buckets": cumulative counts per BUCKETS_S bound and +Inf, "sum": seconds}}."""
        out = {}
        for kind in KINDS:
            cumulative, total = [], 0
            for n in self.counts[kind]:
                total += n
                cumulative.append(total)
            out[kind] = {"buckets": cumulative, "sum": self.sums[kind]}
        return out
