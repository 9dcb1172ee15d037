"""The load of the next interval, from the load observed so far.

Request rate: Holt's linear smoothing (a level and a trend), so that a ramp is met ahead
of it rather than one interval late; prompt and output lengths: exponential smoothing
(they change by phase, not by ramp). The horizon is the time a decision takes to act
(a replica's start), so the planner sizes for the load that will be there then.
"""

from __future__ import annotations

from cluster.planner.sizing import Load

LEVEL_ALPHA = 0.5  # observations are already averaged over Serve's look-back window
TREND_BETA = 0.3
LENGTH_ALPHA = 0.5


class LoadForecast:
    def __init__(self) -> None:
        self.level: float | None = None
        self.trend = 0.0  # requests/s per second
        self.prompt_tokens: float | None = None
        self.output_tokens: float | None = None
        self._last_t: float | None = None

    def observe(self, t: float, load: Load) -> None:
        """`load` as observed at time `t` (seconds, increasing)."""
        if self.level is None or self._last_t is None:
            self.level = load.requests_per_s
        else:
            dt = max(t - self._last_t, 1e-3)
            predicted = self.level + self.trend * dt
            level = LEVEL_ALPHA * load.requests_per_s + (1 - LEVEL_ALPHA) * predicted
            self.trend = TREND_BETA * (level - self.level) / dt + (1 - TREND_BETA) * self.trend
            self.level = level
        self._last_t = t
        if load.requests_per_s > 0:  # an idle interval says nothing of the lengths
            self.prompt_tokens = _smooth(self.prompt_tokens, load.prompt_tokens)
            self.output_tokens = _smooth(self.output_tokens, load.output_tokens)

    def predict(self, horizon_s: float) -> Load | None:
        """The load `horizon_s` after the last observation; None before any."""
        if self.level is None:
            return None
        return Load(max(0.0, self.level + self.trend * horizon_s), self.prompt_tokens or 0.0, self.output_tokens or 0.0)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else LENGTH_ALPHA * new + (1 - LENGTH_ALPHA) * old
