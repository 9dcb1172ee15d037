"""The planner's loop: Serve's application-level autoscaling policy for the two tiers.

Serve makes one `SloPlanner` in its controller (the application config's
`autoscaling_policy`, built by cluster/launch/planner.py) and calls it every control-loop
tick with each autoscaled deployment's context. Every `interval_s` it:

    1. reads the replicas' reports (record_autoscaling_stats: their step costs and load,
       averaged by Serve over the look-back window)
    2. calibrates: the current split's prediction against the TTFT/ITL observed under it
    3. forecasts the load `horizon_s` ahead (a replica's start), and sizes for it or for
       the load now, whichever is higher
    4. predicts every split in the bounds and budget, chooses (sizing.choose), and moves
       the tiers there once another split came `confirm` times in a row: a tier that grows
       at once, one that shrinks once the choice lasted `downscale_s` (sooner where the
       budget needs its replicas for the other)

Between evaluations, and whenever it cannot decide (too few steps seen yet), it returns the
current targets. It runs inside Serve's control loop: it must be fast and never raise (an
error is logged and leaves the targets as they are). Its state is not kept across a
controller restart: a new controller's planner learns again from the replicas' reports.
What it decided, and from what, is published to Redis (`STATUS_KEY`) for /metrics and
`pdserve status`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict

from cluster.kv.redis_client import connect_sync
from cluster.planner.costs import EngineCosts
from cluster.planner.forecast import LoadForecast
from cluster.planner.load import WINDOW_S
from cluster.planner.sizing import Bounds, Load, Prediction, Slo, Split, choose, predict

log = logging.getLogger(__name__)

STATUS_KEY = "pdserve:planner:{app}"
STATUS_TTL_S = 120  # a planner that stopped publishing (its controller gone) fades from /metrics
CALIBRATION_ALPHA = 0.3
CALIBRATION_RANGE = (0.25, 4.0)  # observed / predicted: beyond this the model, not the factor, is wrong
LITTLE_MIN_ARRIVALS = 20  # in a load window, for Little's law on the requests held (a count's noise ~ 1/sqrt)


class Calibration:
    """observed / predicted for TTFT and ITL, smoothed: the model ranks the splits, the
    factors bring its figures to what this cluster shows."""

    def __init__(self) -> None:
        self.ttft = self.itl = 1.0

    def update(self, predicted: Prediction, observed_ttft: float | None, observed_itl: float | None) -> None:
        self.ttft = _toward(self.ttft, observed_ttft, predicted.ttft_s)
        self.itl = _toward(self.itl, observed_itl, predicted.itl_s)


def _toward(factor: float, observed: float | None, predicted: float) -> float:
    if observed is None or not 0 < predicted < math.inf:
        return factor
    ratio = min(max(observed / predicted, CALIBRATION_RANGE[0]), CALIBRATION_RANGE[1])
    return (1 - CALIBRATION_ALPHA) * factor + CALIBRATION_ALPHA * ratio


class SloPlanner:
    def __init__(self, *, ttft_ms: float, itl_ms: float, bounds: dict, tiers: dict[str, str], step_slowdown: float,
                 interval_s: float = 5.0, confirm: int = 2, downscale_s: float = 30.0, horizon_s: float = 10.0,
                 redis_url: str | None = None, seed_costs: dict[str, dict] | None = None,
                 app_name: str = "pdserve", clock=time.time):
        """`tiers`: {"prefill": deployment name, "decode": deployment name}; `bounds`:
        sizing.Bounds's fields; `step_slowdown`: the decode tier's (for prompts it computes);
        `seed_costs`: per tier, EngineCosts's fields (a profile: cluster/planner/profile.py),
        used until the tier's replicas have fitted their own."""
        self.slo = Slo(ttft_ms / 1e3, itl_ms / 1e3)
        self.bounds = Bounds(**bounds)
        self.tiers = tiers
        self.step_slowdown = step_slowdown
        self.interval_s, self.confirm, self.downscale_s, self.horizon_s = interval_s, confirm, downscale_s, horizon_s
        self.clock = clock
        self.forecast = LoadForecast()
        self.calibration = Calibration()
        self._next_eval = 0.0
        self._pending_count = 0  # evaluations in a row that chose another split than the current one
        self._pending_since: float | None = None  # ... since this time
        self._known_costs: dict[str, EngineCosts] = {tier: EngineCosts(**c) for tier, c in (seed_costs or {}).items()}
        self.status: dict = {"state": "learning"}
        self._redis = connect_sync(redis_url, socket_timeout=0.2, socket_connect_timeout=0.2) if redis_url else None
        self._status_key = STATUS_KEY.format(app=app_name)
        self._publish_failed_at = -math.inf

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_tier = {tier: ctx for ctx in contexts.values() for tier, name in self.tiers.items() if ctx.deployment_name == name}
        current = {ctx.deployment_id: ctx.target_num_replicas for ctx in contexts.values()}
        try:
            if len(by_tier) == 2 and self.clock() >= self._next_eval:
                self._next_eval = self.clock() + self.interval_s
                split = self.evaluate(by_tier)
                if split is not None:
                    current[by_tier["prefill"].deployment_id] = split.prefill
                    current[by_tier["decode"].deployment_id] = split.decode
        except Exception:  # noqa: BLE001 - inside Serve's control loop: never raise
            log.exception("the SLO planner failed; the tiers keep their replicas")
        return current, {}

    def evaluate(self, by_tier: dict) -> Split | None:
        """One evaluation: the split to move to, or None to stay."""
        now = self.clock()
        current = Split(by_tier["prefill"].target_num_replicas, by_tier["decode"].target_num_replicas)
        reports = {tier: _replica_reports(ctx) for tier, ctx in by_tier.items()}
        # A tier scaled to 0 reports nothing: its costs as last known.
        prefill_costs = EngineCosts.from_reports(reports["prefill"], reports["decode"]) or self._known_costs.get("prefill")
        decode_costs = EngineCosts.from_reports(reports["decode"], reports["prefill"]) or self._known_costs.get("decode")
        self._known_costs.update({k: v for k, v in (("prefill", prefill_costs), ("decode", decode_costs)) if v})
        observed, observed_ttft, observed_itl = _observed(reports)
        self.status = {"t": now, "state": "learning", "current": str(current), "slo_ttft_s": self.slo.ttft_s,
                       "slo_itl_s": self.slo.itl_s, "observed": vars(observed) if observed else None,
                       "observed_ttft_s": observed_ttft, "observed_itl_s": observed_itl,
                       "replicas": {"prefill": current.prefill, "decode": current.decode}}
        if observed is not None and observed.requests_per_s == 0 and (prefill_costs is None or decode_costs is None):
            # Idle before any cost is known (a fresh cluster nobody uses): the smallest split
            # meets any target at no load; a model is needed only to size for load.
            self.forecast.observe(now, observed)
            return self._decide(current, self.bounds.splits()[0], "idle") if self.bounds.splits() else None
        if observed is None or prefill_costs is None or decode_costs is None:
            self._publish()
            return None
        self.forecast.observe(now, observed)
        self.calibration.update(predict(current, observed, prefill_costs, decode_costs, self.step_slowdown),
                                observed_ttft, observed_itl)
        expected = _larger(self.forecast.predict(self.horizon_s), observed)
        predictions = {s: predict(s, expected, prefill_costs, decode_costs, self.step_slowdown)
                       .scaled(self.calibration.ttft, self.calibration.itl) for s in self.bounds.splits()}
        if not predictions:
            self._publish()
            return None
        now_predicted = predictions.get(current, Prediction(math.inf, math.inf))  # (outside the budget: none)
        self.status.update(
            forecast=vars(expected), calibration={"ttft": self.calibration.ttft, "itl": self.calibration.itl},
            costs={"prefill": vars(prefill_costs), "decode": vars(decode_costs)},
            predicted={str(s): _finite(vars(p)) for s, p in predictions.items()},
            predicted_ttft_s=_finite_value(now_predicted.ttft_s), predicted_itl_s=_finite_value(now_predicted.itl_s),
        )
        return self._decide(current, choose(predictions, self.slo, self.bounds), "steady")

    def _decide(self, current: Split, chosen: Split, steady: str) -> Split | None:
        """Move toward `chosen` once another split than the current one was chosen `confirm`
        times in a row (the latest choice is made: near-equal splits alternating must not
        hold a move back): a tier it grows grows now; a tier it shrinks shrinks once the
        choice lasted `downscale_s` (a gap between sparse arrivals must not send a replica
        away that the next one needs: a start costs seconds, while an extra replica costs
        only its share of the budget for a while), or sooner as far as the budget needs its
        replicas for the tier that grows. Publish the status either way."""
        now = self.clock()
        if chosen == current:
            self._pending_count, self._pending_since = 0, None
        else:
            self._pending_count += 1
            self._pending_since = self._pending_since if self._pending_since is not None else now
        target = current
        if self._pending_count >= self.confirm:
            target = chosen if now - self._pending_since >= self.downscale_s else self._grown(current, chosen)
        move = target != current
        self.status.update(state="moving" if move else steady if chosen == current else "confirming", chosen=str(chosen))
        if move:
            log.info("SLO planner: %s -> %s (%s)", current, target, self.status.get("forecast") or "idle")
            if target == chosen:
                self._pending_count, self._pending_since = 0, None
            self.status["replicas"] = {"prefill": target.prefill, "decode": target.decode}
        self._publish()
        return target if move else None

    def _grown(self, current: Split, chosen: Split) -> Split:
        """`current` with the tiers `chosen` grows grown, and the others shrunk toward
        `chosen` only as far as the budget needs."""
        target = Split(max(current.prefill, chosen.prefill), max(current.decode, chosen.decode))
        while self.bounds.cost(target) > self.bounds.budget + 1e-9:
            if target.prefill > chosen.prefill:
                target = Split(target.prefill - 1, target.decode)
            elif target.decode > chosen.decode:
                target = Split(target.prefill, target.decode - 1)
            else:
                break
        return target

    def _publish(self) -> None:
        if self._redis is None or self.clock() - self._publish_failed_at < STATUS_TTL_S:
            return
        try:
            self._redis.set(self._status_key, json.dumps(self.status), ex=STATUS_TTL_S)
        except Exception as e:  # noqa: BLE001 - Redis down: the decision stands, its record waits
            self._publish_failed_at = self.clock()
            log.warning("SLO planner: cannot publish its status to Redis: %s", e)


def _replica_reports(ctx) -> list[dict[str, float]]:
    """Each running replica's last reported figures ({name: value}), from Serve's
    aggregated custom metrics ({name: {replica: value}})."""
    by_replica: dict = defaultdict(dict)
    for name, values in (ctx.aggregated_metrics or {}).items():
        for replica, value in values.items():
            if value is not None and math.isfinite(value):
                by_replica[replica][name] = value
    return list(by_replica.values())


def _observed(reports: dict[str, list[dict]]) -> tuple[Load | None, float | None, float | None]:
    """The load arriving (every generation passes a decode replica, which sees its prompt's
    length) and the decode replicas' TTFT/ITL, weighted by their requests. Prompt work per
    request is the prompt less what the prefix caches find, where the prompts compute: the
    prefill tier, or with none the decode tier."""
    decode = reports["decode"]
    if not decode:
        return None, None, None
    rate = sum(r.get("requests_per_s", 0.0) for r in decode)
    if rate <= 0:  # no arrival: idle once nothing runs either (else wait: the running ones hold their replicas)
        return (Load(0.0, 0.0, 0.0) if not any(r.get("running_requests", 0.0) for r in decode) else None), None, None
    # Answers' length: the mean of those that ended, or more if the running ones already
    # have more, or, with arrivals enough to count on, if Little's law says so: N requests
    # held at a rate r, each a TTFT and (output - 1) gaps of ITL, hold N = r (TTFT + (output
    # - 1) ITL). The last two see a phase of longer answers at once, the first only once
    # they end. (At a few arrivals a window, N and r swing the third by hundreds of tokens.)
    ttft, itl = _weighted(decode, "ttft_s"), _weighted(decode, "itl_s")
    lengths = [x for x in (_weighted(decode, "output_tokens_per_request"),
                           _weighted(decode, "running_output_tokens_per_request")) if x is not None]
    held = sum(r.get("running_requests", 0.0) for r in decode)
    if ttft is not None and itl and rate * WINDOW_S >= LITTLE_MIN_ARRIVALS:
        lengths.append((held / rate - ttft) / itl + 1)
    if not lengths:  # requests, none with a token yet: their lengths are not known
        return None, None, None
    prompt = _weighted(decode, "prompt_tokens_per_request") or 0.0
    hits = _weighted(reports["prefill"], "prefix_hit_share")
    hits = _weighted(decode, "prefix_hit_share") if hits is None else hits
    return Load(rate, prompt * (1.0 - (hits or 0.0)), max(lengths)), ttft, itl


def _larger(forecast: Load, observed: Load) -> Load:
    """The load to size for: the forecast where it is higher (a ramp met ahead), else what
    is there now (a forecast falling at a phase's end must not send away what the load
    still needs; the next intervals show whether it really fell)."""
    return Load(*(max(f, o) for f, o in zip(vars(forecast).values(), vars(observed).values())))


def _weighted(reports: list[dict], name: str) -> float | None:
    known = [(r[name], r.get("requests_per_s", 0.0) + 1e-9) for r in reports if name in r]
    if not known:
        return None
    return sum(v * w for v, w in known) / sum(w for _, w in known)


def _finite_value(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _finite(d: dict) -> dict:
    return {k: _finite_value(v) for k, v in d.items()}
