"""What a replica saw over the last WINDOW_S: arrivals, prompt and output lengths, and the
TTFT/ITL its requests got; reported through Serve's autoscaling metrics (floats only).

    requests_per_s               requests that arrived (decode workers: every generation)
    computed_prompt_tokens_per_s prompt tokens its engine computed (after prefix-cache hits)
    output_tokens_per_request    mean over the requests that finished
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
        self._arrivals: deque[float] = deque(maxlen=MAX_SAMPLES)
        self._computed: deque[tuple[float, int]] = deque(maxlen=MAX_SAMPLES)
        self._outputs: deque[tuple[float, int]] = deque(maxlen=MAX_SAMPLES)
        self._ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._itl: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._running = 0

    def arrived(self) -> None:
        self._arrivals.append(self.clock())
        self._running += 1

    def ended(self) -> None:
        """An arrived request is over, however it ended."""
        self._running -= 1

    def computed(self, t: float, prompt_tokens: int) -> None:
        """The engine computed `prompt_tokens` of prompts in a step that began at `t`."""
        if prompt_tokens:
            self._computed.append((t, prompt_tokens))

    def first_token(self, seconds: float) -> None:
        self._ttft.append((self.clock(), seconds))

    def token_gap(self, seconds: float) -> None:
        self._itl.append((self.clock(), seconds))

    def finished(self, output_tokens: int) -> None:
        self._outputs.append((self.clock(), output_tokens))

    def report(self) -> dict[str, float]:
        now = self.clock()
        since = now - self.window_s
        for events in (self._computed, self._outputs, self._ttft, self._itl):
            while events and events[0][0] < since:
                events.popleft()
        while self._arrivals and self._arrivals[0] < since:
            self._arrivals.popleft()
        span = max(min(self.window_s, now - self._start), 1e-3)
        out = {"requests_per_s": len(self._arrivals) / span,
               "computed_prompt_tokens_per_s": sum(n for _, n in self._computed) / span,
               "running_requests": float(self._running)}
        if self._outputs:
            out["output_tokens_per_request"] = float(np.mean([n for _, n in self._outputs]))
        if self._ttft:
            out["ttft_s"] = float(np.median([s for _, s in self._ttft]))
        if self._itl:
            out["itl_s"] = float(np.median([s for _, s in self._itl]))
        return out
