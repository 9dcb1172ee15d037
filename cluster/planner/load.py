"""What a replica saw over the last WINDOW_S: arrivals, prompt and output lengths, and the
TTFT/ITL its requests got; reported through Serve's autoscaling metrics (floats only).

    requests_per_s               requests that arrived (decode workers: every generation)
    prompt_tokens_per_request    their mean prompt length: what arrives, not what the engines
                                 got through (which a saturated tier caps: sized by it, the
                                 tier would grow by its headroom each round)
    prefix_hit_share             of the prompt tokens its engine looked up, those it found
                                 cached (prompt work is the rest)
    output_tokens_per_request    mean over the requests that finished
    running_output_tokens_per_request  mean generated so far by those running: a lower bound
                                 of their lengths, known before they end (a phase of long
                                 answers shows in it at once, in the finished ones only
                                 after an answer's whole length)
    ttft_s, itl_s                medians over the window's first tokens and token gaps
                                 (a decode worker's view: from its call to each delta)
    running_requests             requests arrived and not ended, now
A figure with no sample in the window is left out. A sliding window, not the interval
since the last report: arrivals come in bursts (a batch of first tokens, then none for
a while), and a rate over a few seconds would swing with them.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

WINDOW_S = 10.0
MAX_SAMPLES = 20000  # per kind within the window: the median of the latest ones is as good as of all


class LoadMeter:
    def __init__(self, window_s: float = WINDOW_S, clock=time.time):
        self.window_s, self.clock = window_s, clock
        self._start = clock()
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=MAX_SAMPLES)  # (t, prompt tokens)
        self._lookups: deque[tuple[float, int, int]] = deque(maxlen=MAX_SAMPLES)  # (t, looked up, found)
        self._outputs: deque[tuple[float, int]] = deque(maxlen=MAX_SAMPLES)
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._itl: deque[tuple[float, float, int]] = deque(maxlen=MAX_SAMPLES)  # (t, gap, how many such gaps)
        self._running = 0
        self._running_tokens = 0  # generated so far by the running requests

    def arrived(self, prompt_tokens: int) -> None:
        self._arrivals.append((self.clock(), prompt_tokens))
        self._running += 1

    def generated(self, tokens: int) -> None:
        """A running request generated `tokens` more."""
        self._running_tokens += tokens

    def ended(self, tokens: int) -> None:
        """An arrived request is over, however it ended, having generated `tokens`."""
        self._running -= 1
        self._running_tokens -= tokens

    def prefix_lookups(self, looked_up: int, found: int) -> None:
        """The engine looked up `looked_up` prompt tokens in its prefix cache since the last
        call and found `found` of them."""
        if looked_up:
            self._lookups.append((self.clock(), looked_up, found))

    def first_token(self, seconds: float) -> None:
        self._ttft.append((self.clock(), seconds))

    def token_gap(self, seconds: float, count: int = 1) -> None:
        self._itl.append((self.clock(), seconds, count))

    def finished(self, output_tokens: int) -> None:
        self._outputs.append((self.clock(), output_tokens))

    def report(self) -> dict[str, float]:
        now = self.clock()
        since = now - self.window_s
        for events in (self._arrivals, self._lookups, self._outputs, self._ttft, self._itl):
            while events and events[0][0] < since:
                events.popleft()
        span = max(min(self.window_s, now - self._start), 1e-3)
        out = {"requests_per_s": len(self._arrivals) / span, "running_requests": float(self._running)}
        if self._arrivals:
            out["prompt_tokens_per_request"] = float(np.mean([n for _, n in self._arrivals]))
        if self._lookups:
            out["prefix_hit_share"] = sum(f for _, _, f in self._lookups) / sum(n for _, n, _ in self._lookups)
        if self._running > 0:
            out["running_output_tokens_per_request"] = self._running_tokens / self._running
        if self._outputs:
            out["output_tokens_per_request"] = float(np.mean([n for _, n in self._outputs]))
        if self._ttft:
            out["ttft_s"] = float(np.median([s for _, s in self._ttft]))
        if self._itl:
            gaps = np.array([(s, n) for _, s, n in self._itl])
            out["itl_s"] = float(np.quantile(gaps[:, 0], 0.5, weights=gaps[:, 1], method="inverted_cdf"))
        return out

