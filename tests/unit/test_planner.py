"""The SLO planner's parts without a cluster: the online cost fit, the load meter and
forecast, the sizing model and choice, and the Serve policy itself, called with Serve's
own AutoscalingContext objects, publishing to a real Redis."""

import asyncio
import math
import random

import numpy as np
import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingContext

from cluster.engine.step_timeline import StepRecord
from cluster.launch.redis_server import PrivateRedis
from cluster.launch.status import planner_line
from cluster.planner.costs import MIN_SAMPLES, DecayingFit, EngineCosts, StepCostModel
from cluster.planner.forecast import LoadForecast
from cluster.planner.load import LoadMeter
from cluster.planner.policy import SloPlanner
from cluster.planner.sizing import INF, Bounds, Load, Prediction, Slo, Split, choose, md1_wait, predict
from router.metrics import GatewayMetrics
from router.planner_status import PlannerStatus

COSTS = EngineCosts(decode_base_s=0.020, decode_per_seq_s=0.001, prompt_base_s=0.010, prompt_per_token_s=0.001, chunk_tokens=512)


def steps(n, decode_base=0.02, per_seq=0.001, prompt_base=0.01, per_token=0.001, noise=0.0, seed=0):
    """Hand-made step records of an engine with these costs: decode-only steps at batch
    1-16, and steps with prompt chunks of 16-512 tokens beside 0-8 decodes."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        running = rng.randint(1, 16)
        if i % 3:
            step = decode_base + per_seq * running
            out.append(StepRecord(float(i), step * (1 + rng.uniform(-noise, noise)), step, 0.0, running, 0))
        else:
            prompt, decodes = rng.randint(16, 512), rng.randint(0, 8)
            step = prompt_base + per_token * prompt + per_seq * decodes
            out.append(StepRecord(float(i), step * (1 + rng.uniform(-noise, noise)), step, 0.0, decodes, prompt))
    return out


def test_the_step_cost_fit_recovers_the_engine_s_costs_and_reports_only_what_it_saw():
    model = StepCostModel(chunk_tokens=512)
    assert model.report() == {}  # nothing seen: nothing claimed
    model.observe(steps(600, noise=0.05))
    r = model.report()
    assert r["decode_base_s"] == pytest.approx(0.02, rel=0.05) and r["decode_per_seq_s"] == pytest.approx(0.001, rel=0.1)
    assert r["prompt_base_s"] == pytest.approx(0.01, rel=0.25) and r["prompt_per_token_s"] == pytest.approx(0.001, rel=0.05)
    assert r["chunk_tokens"] == 512
    decode_only = StepCostModel(chunk_tokens=512)  # a disaggregated decode tier: no prompt steps
    decode_only.observe([s for s in steps(300) if not s.prompt])
    assert set(decode_only.report()) == {"decode_base_s", "decode_per_seq_s"}


def test_the_fit_drops_a_cost_it_cannot_see_and_follows_an_engine_whose_costs_move():
    fit = DecayingFit(2, half_life=50)
    fit.add(*_rows([(1.0, 4.0, 0.03)] * (MIN_SAMPLES - 1)))
    assert fit.coefficients() is None  # too few samples yet
    fit.add(*_rows([(1.0, 4.0, 0.03)] * MIN_SAMPLES))
    base, per_seq = fit.coefficients()  # one batch size only: the slope is not identifiable
    assert per_seq >= 0 and base + 4 * per_seq == pytest.approx(0.03, rel=1e-3)
    fit.add(*_rows([(1.0, b, 0.05 - 0.001 * b) for b in range(1, 9)] * 40))  # a negative slope: dropped, not fitted
    assert (fit.coefficients() >= 0).all()
    fit.add(*_rows([(1.0, b, 0.01 + 0.002 * b) for b in range(1, 9)] * 100))  # the costs moved: the old steps fade
    base, per_seq = fit.coefficients()
    assert base == pytest.approx(0.01, rel=0.05) and per_seq == pytest.approx(0.002, rel=0.05)


def _rows(rows):
    a = np.array(rows, dtype=float)
    return a[:, :2], a[:, 2]


def test_a_tier_s_costs_are_the_median_of_its_replicas_and_borrow_what_it_never_computes():
    fast, slow = COSTS, EngineCosts(0.2, 0.01, 0.1, 0.01, 512)
    decode_reports = [{"decode_base_s": c.decode_base_s, "decode_per_seq_s": c.decode_per_seq_s} for c in (fast, fast, slow)]
    prefill_reports = [{"prompt_base_s": 0.01, "prompt_per_token_s": 0.001, "chunk_tokens": 512}]
    decode = EngineCosts.from_reports(decode_reports, prefill_reports)
    assert decode == COSTS  # the slow replica does not move the median; prompt terms from the prefill tier
    assert EngineCosts.from_reports(decode_reports) is None  # no prompt terms anywhere yet
    assert EngineCosts.from_reports([]) is None


def test_the_load_meter_reports_its_sliding_window():
    now = [100.0]
    meter = LoadMeter(window_s=10.0, clock=lambda: now[0])
    now[0] = 110.0  # a full window since it began
    for prompt in (100, 200, 300, 400):
        meter.arrived(prompt)
    meter.prefix_lookups(1000, 250)
    meter.prefix_lookups(0, 0)  # nothing looked up since
    meter.first_token(0.5)
    meter.first_token(0.7)
    for gap in (0.01, 0.02, 0.03):
        meter.token_gap(gap)
    meter.generated(100 + 300 + 50 + 400)  # the four so far
    meter.finished(100)
    meter.finished(300)
    meter.ended(100)
    assert meter.report() == {
        "requests_per_s": 0.4, "prompt_tokens_per_request": 250.0, "prefix_hit_share": 0.25,
        "output_tokens_per_request": 200.0, "ttft_s": 0.6, "itl_s": 0.02, "running_requests": 3.0,
        "running_output_tokens_per_request": 250.0,  # (300 + 50 + 400) / 3: already longer than those that ended
    }
    meter.token_gap(0.05, count=10)  # ten gaps of one step at once (the simulation's)
    assert meter.report()["itl_s"] == 0.05
    now[0] = 115.0
    meter.arrived(1000)
    assert meter.report()["requests_per_s"] == 0.5  # the window still holds the first four
    now[0] = 121.0  # they left it; the last one is still in
    for tokens in (300, 50, 400):
        meter.ended(tokens)
    assert meter.report() == {"requests_per_s": 0.1, "prompt_tokens_per_request": 1000.0, "running_requests": 1.0,
                              "running_output_tokens_per_request": 0.0}


def test_the_forecast_meets_a_ramp_ahead_and_an_idle_interval_keeps_the_lengths():
    forecast = LoadForecast()
    assert forecast.predict(10) is None
    for t in range(0, 60, 5):
        forecast.observe(t, Load(0.1 * t, 500, 100))  # +0.1 req/s every second
    ahead = forecast.predict(10)
    assert ahead.requests_per_s > 5.5 + 0.5  # beyond the last observation, toward where the ramp goes
    assert (ahead.prompt_tokens, ahead.output_tokens) == pytest.approx((500, 100))
    forecast.observe(65, Load(0.0, 0.0, 0.0))
    assert forecast.predict(0).prompt_tokens == pytest.approx(500)


def test_predictions_move_the_right_way_and_saturate():
    load = Load(1.0, 500, 100)  # 0.51 s of prompt work per request

    def p(split, load=load):
        return predict(split, load, COSTS, COSTS, step_slowdown=1.2)

    assert p(Split(1, 2)).itl_s < p(Split(1, 1)).itl_s  # more decode replicas: a smaller batch each
    assert p(Split(2, 1)).ttft_s < p(Split(1, 1)).ttft_s  # more prefill replicas: less queueing
    assert p(Split(1, 1), Load(1.5, 500, 100)).ttft_s > p(Split(1, 1)).ttft_s
    assert p(Split(1, 1), Load(2.0, 500, 100)).ttft_s == INF  # 2 x 0.51 s of prompt work per second: saturated
    colocated, disaggregated = p(Split(0, 2)), p(Split(1, 1))
    assert colocated.itl_s > COSTS.decode_step_s(0)  # prompts computed beside the decodes slow them
    assert disaggregated.itl_s < colocated.itl_s
    idle = p(Split(0, 1), Load(0.0, 0.0, 0.0))
    assert (idle.ttft_s, idle.itl_s) == (0.0, COSTS.decode_base_s)


def test_the_choice_is_the_cheapest_split_that_meets_both_slos_else_the_best_one_in_the_budget():
    bounds = Bounds(min_prefill=0, max_prefill=2, min_decode=1, max_decode=3, budget=4)
    assert Split(2, 3) not in bounds.splits() and bounds.splits()[0] == Split(0, 1)
    slo = Slo(ttft_s=1.0, itl_s=0.05)
    predictions = {s: Prediction(1.0 / (s.prefill + 1), 0.1 / s.decode) for s in bounds.splits()}
    # TTFT 1/(P+1) <= 0.8 needs P >= 1; ITL 0.1/D <= 0.04 needs D >= 3: the cheapest is 1P3D.
    assert choose(predictions, slo, bounds) == Split(1, 3)
    tight = Slo(ttft_s=0.1, itl_s=0.01)  # nothing meets it: the best worst-ratio, then the cheaper
    assert choose(predictions, tight, bounds) == max(predictions, key=lambda s: (predictions[s].score(tight), -bounds.cost(s)))
    saturated = {s: Prediction(INF, INF) for s in bounds.splits()}
    assert bounds.cost(choose(saturated, slo, bounds)) == 4  # every split saturates: the largest


class Deployment:
    def __init__(self, name, replicas):
        self.id = DeploymentID(name=name, app_name="pdserve")
        self.replicas = replicas
        self.reports: dict[str, float] = {}

    def context(self, now):
        ids = [ReplicaID(unique_id=f"{self.id.name}-{i}", deployment_id=self.id) for i in range(self.replicas)]
        metrics = {name: {r: value for r in ids} for name, value in self.reports.items()}
        return AutoscalingContext(
            deployment_id=self.id, deployment_name=self.id.name, app_name="pdserve", current_num_replicas=self.replicas,
            target_num_replicas=self.replicas, running_replicas=ids, total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=0, capacity_adjusted_max_replicas=4,
            policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=None,
        )


def planner(redis_url=None, clock=None, downscale_s=0.0, **bounds):
    return SloPlanner(ttft_ms=1500, itl_ms=40, tiers={"prefill": "PrefillWorker", "decode": "DecodeWorker"},
                      bounds={"min_prefill": 0, "max_prefill": 1, "min_decode": 1, "max_decode": 3, "budget": 4, **bounds},
                      step_slowdown=1.2, interval_s=5.0, confirm=2, downscale_s=downscale_s, redis_url=redis_url, clock=clock)


def test_the_policy_adds_decode_replicas_when_the_itl_target_is_missed_and_publishes_why():
    """Serve's application-level policy contract: one call with every autoscaled
    deployment's context, {deployment: replicas} back. Under a decode-heavy load on 1P1D
    the planner moves to more decode replicas, after confirming, and says so in Redis."""
    now = [1000.0]
    prefill, decode = Deployment("PrefillWorker", 1), Deployment("DecodeWorker", 1)
    prefill.reports = {"prompt_base_s": 0.01, "prompt_per_token_s": 0.001, "chunk_tokens": 512, "requests_per_s": 0.0,
                       "prefix_hit_share": 0.5}
    # 4 req/s x 200 output tokens on one decode replica: ITL 20 ms + 1 ms x ~160 running.
    decode.reports = {"decode_base_s": 0.02, "decode_per_seq_s": 0.001, "requests_per_s": 4.0,
                      "prompt_tokens_per_request": 200.0, "output_tokens_per_request": 200.0, "ttft_s": 0.3, "itl_s": 0.09}
    with PrivateRedis() as redis:
        policy = planner(redis.url, clock=lambda: now[0], downscale_s=30.0)  # (a move up does not wait for it)
        decisions = []
        for _ in range(3):
            contexts = {d.id: d.context(now[0]) for d in (prefill, decode)}
            targets, state = policy(contexts)
            assert state == {} and set(targets) == {prefill.id, decode.id}
            decisions.append((targets[prefill.id], targets[decode.id]))
            now[0] += 5.0
        assert decisions[0] == (1, 1)  # chosen once: not yet
        assert decisions[1][1] >= 2 and decisions[1][0] + decisions[1][1] <= 4  # confirmed: more decode, in the budget
        status = asyncio.run(PlannerStatus(redis.url).read())
        assert status["state"] in ("moving", "steady", "confirming") and status["observed_itl_s"] == pytest.approx(0.09)
        assert status["slo_itl_s"] == 0.04 and status["forecast"]["requests_per_s"] > 0
        assert status["observed"]["prompt_tokens"] == 100.0  # 200-token prompts, half found in the prefill's cache
        text = GatewayMetrics("t").render({}, {}, status).decode()
        assert 'pdserve_planner_seconds{kind="observed",slo="itl"} 0.09' in text
        assert 'pdserve_planner_replicas{tier="decode"}' in text
        assert "ITL 90 ms observed" in planner_line(status)


def test_the_policy_waits_while_it_cannot_know_and_never_raises():
    now = [0.0]
    prefill, decode = Deployment("PrefillWorker", 1), Deployment("DecodeWorker", 1)
    policy = planner(clock=lambda: now[0])
    targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})  # no reports yet: learning, no change
    assert targets == {prefill.id: 1, decode.id: 1} and policy.status["state"] == "learning"
    decode.reports = {"requests_per_s": 1.0, "ttft_s": 0.2}  # requests, but no cost fitted and none finished yet
    now[0] += 10
    targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})
    assert targets == {prefill.id: 1, decode.id: 1} and policy.status["state"] == "learning"
    decode.reports = {"decode_base_s": math.nan, "requests_per_s": "garbage"}  # a broken report
    now[0] += 10
    targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})
    assert targets == {prefill.id: 1, decode.id: 1}


@pytest.mark.parametrize("costs_known", [True, False])
def test_an_idle_cluster_shrinks_to_the_smallest_split(costs_known):
    now = [0.0]
    prefill, decode = Deployment("PrefillWorker", 1), Deployment("DecodeWorker", 2)
    prefill.reports = {"requests_per_s": 0.0}
    decode.reports = {"requests_per_s": 0.0}
    if costs_known:
        prefill.reports.update(prompt_base_s=0.01, prompt_per_token_s=0.001, chunk_tokens=512)
        decode.reports.update(decode_base_s=0.02, decode_per_seq_s=0.001)
    policy = planner(clock=lambda: now[0])
    decode.reports["running_requests"] = 2.0  # no arrival, but two long answers still decoding: not idle yet
    for _ in range(3):
        targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})
        now[0] += 5
    assert targets == {prefill.id: 1, decode.id: 2}
    decode.reports["running_requests"] = 0.0
    states = []
    for _ in range(2):
        targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})
        states.append(policy.status["state"])
        now[0] += 5
    assert targets == {prefill.id: 0, decode.id: 1} and states == ["confirming", "moving"]


def test_a_tier_scaled_to_zero_keeps_its_last_known_costs():
    """0P1D reports no prefill replica's costs: the planner sizes with the costs it last
    saw, so that load coming back can bring the prefill tier back."""
    now = [0.0]
    prefill, decode = Deployment("PrefillWorker", 1), Deployment("DecodeWorker", 1)
    prefill.reports = {"prompt_base_s": 0.01, "prompt_per_token_s": 0.002, "chunk_tokens": 512, "requests_per_s": 0.0}
    decode.reports = {"decode_base_s": 0.02, "decode_per_seq_s": 0.001, "requests_per_s": 0.0}
    policy = planner(clock=lambda: now[0], max_decode=1)
    for _ in range(2):  # idle: 0P1D
        targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})
        now[0] += 5
    assert targets[prefill.id] == 0
    prefill.replicas, prefill.reports = 0, {}
    # Load is back, on the decode replica alone: 2 req/s of 500-token prompts beside the decodes
    # (1 s of prompt work per second on one engine) cannot meet the TTFT target; 1P1D can.
    decode.reports = {"decode_base_s": 0.02, "decode_per_seq_s": 0.001, "requests_per_s": 0.5,
                      "prompt_tokens_per_request": 500.0, "output_tokens_per_request": 50.0, "ttft_s": 9.0, "itl_s": 0.05}
    for _ in range(2):
        targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})
        now[0] += 5
    assert targets == {prefill.id: 1, decode.id: 1}
    assert policy.status["costs"]["prefill"]["prompt_per_token_s"] == 0.002


def test_a_cheaper_split_waits_for_its_choice_to_last_and_a_costlier_one_does_not():
    """Sparse arrivals leave the window empty between them: scaling down on each gap would
    start a replica again at the next arrival (seconds each). A move down waits until the
    cheaper choice lasted downscale_s; a move up only for `confirm` evaluations."""
    now = [0.0]
    prefill, decode = Deployment("PrefillWorker", 1), Deployment("DecodeWorker", 2)
    prefill.reports = {"prompt_base_s": 0.01, "prompt_per_token_s": 0.001, "chunk_tokens": 512, "requests_per_s": 0.0}
    decode.reports = {"decode_base_s": 0.02, "decode_per_seq_s": 0.001, "requests_per_s": 0.0}
    policy = planner(clock=lambda: now[0], downscale_s=30.0)
    moves = []
    for _ in range(7):  # idle: 0P1D is chosen at every evaluation, 5 s apart
        targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})
        moves.append(targets[decode.id])
        now[0] += 5
    assert moves == [2] * 6 + [1]  # chosen from 0 s on, moved once it lasted 30 s


@pytest.mark.parametrize("budget", [3, 2])
def test_a_tier_that_must_grow_grows_at_once_and_the_other_shrinks_when_it_lasted_or_the_budget_binds(budget):
    """A phase of long answers: 0P2D is the cheapest split that meets the ITL target (the
    prompts are short). Its decode replica is added after `confirm`, not after the downscale
    wait; the prefill replica stays until that wait is over, unless the budget needs its
    core for the decode replica now."""
    now = [0.0]
    prefill, decode = Deployment("PrefillWorker", 1), Deployment("DecodeWorker", 1)
    prefill.reports = {"prompt_base_s": 0.01, "prompt_per_token_s": 0.001, "chunk_tokens": 512, "requests_per_s": 0.0}
    decode.reports = {"decode_base_s": 0.02, "decode_per_seq_s": 0.001, "prompt_tokens_per_request": 10.0,
                      "output_tokens_per_request": 200.0, "ttft_s": 0.04}
    policy = planner(clock=lambda: now[0], downscale_s=30.0, max_decode=2, budget=budget)
    splits = []
    for _ in range(8):  # each decode replica sees its share, with the ITL the model predicts for it
        decode.reports.update(requests_per_s=2.0 / decode.replicas, itl_s=0.033 if decode.replicas == 1 else 0.025)
        targets, _ = policy({d.id: d.context(now[0]) for d in (prefill, decode)})
        splits.append((targets[prefill.id], targets[decode.id]))
        prefill.replicas, decode.replicas = splits[-1]
        now[0] += 5
    assert policy.status["chosen"] == "0P2D"
    if budget == 3:
        assert splits == [(1, 1)] + [(1, 2)] * 5 + [(0, 2)] * 2  # decode at once; prefill gone 30 s after the first choice
    else:
        assert splits == [(1, 1)] + [(0, 2)] * 7  # no core for a second decode replica beside the prefill one


def test_the_fit_learns_what_attention_adds_to_long_prompts_and_a_prompt_s_cost_is_its_chunks():
    rng = random.Random(3)
    records = []
    for i in range(300):  # chunks of 16-512 tokens at 0-3k positions, beside 0-8 decodes
        tokens, start, decodes = rng.randint(16, 512), rng.randint(0, 3000), rng.randint(0, 8)
        context = tokens * (start + tokens / 2)
        step = 0.01 + 0.002 * tokens + 1e-6 * context + 0.001 * decodes
        records.append(StepRecord(float(i), step, step, 0.0, decodes, tokens, context))
    model = StepCostModel(chunk_tokens=512)
    model.observe(records)
    costs = EngineCosts(**{**model.report(), "decode_base_s": 0.02, "decode_per_seq_s": 0.001})
    assert costs.prompt_attention_s == pytest.approx(1e-6, rel=0.01) and costs.prompt_per_token_s == pytest.approx(0.002, rel=0.01)
    # A 1500-token prompt in chunks of 512, 512 and 476: the sum of its steps.
    chunks = [(0, 512), (512, 512), (1024, 476)]
    assert costs.prefill_s(1500) == pytest.approx(sum(costs.chunk_s(n, n * (s + n / 2)) for s, n in chunks))
    assert costs.prefill_s(1500) > 3 * costs.prefill_s(500)  # longer prompts cost more per token
    # The engine thread's work between steps (while requests ran) is part of each iteration.
    busier = StepCostModel(chunk_tokens=512)
    busier.observe([r._replace(between_s=0.005) for r in records])
    assert busier.report()["prompt_base_s"] == pytest.approx(0.015, rel=0.01)


def test_a_colocated_prompt_is_slowed_by_decode_protection_only_while_requests_decode():
    sparse = predict(Split(0, 1), Load(0.05, 500, 2), COSTS, COSTS, step_slowdown=1.2)  # one token each: nothing decodes
    busy = predict(Split(0, 1), Load(0.05, 500, 400), COSTS, COSTS, step_slowdown=1.2)  # long answers decode throughout
    alone = COSTS.prefill_s(500)
    assert sparse.ttft_s < 1.1 * (alone + md1_wait(0.05 * alone, alone))
    assert busy.ttft_s > 2 * sparse.ttft_s  # beside decodes a step gives the prompt a sixth of it
