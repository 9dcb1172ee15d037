"""`pdserve bench serve`'s counting, on hand-made request results: vllm's key names,
TPOT = (latency - TTFT) / (output tokens - 1), goodput against SLOs, failures broken
down; and the arrival process (gamma gaps: mean 1/rate, burstiness sets the spread)."""

import argparse

import numpy as np
import pytest

from cluster.bench import datasets
from cluster.bench.flags import add_serve_flags
from cluster.bench.offline_target import OfflineTarget, offline_target
from cluster.bench.openai_client import RequestResult
from cluster.bench.serve_bench import arrival_times, goodput_slos, parse_metrics, server_deltas, summarize, throughput_over_time
from cluster.bench.sweep_compare import LocalTarget, attainment, local_target, parse_target
from cluster.engine.step_times import Histograms, StepTimes
from cluster.serving import tracing
from cluster.text.tokenizer import Tokenizer
from router.metrics import GatewayMetrics


def args(*extra):
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return p.parse_args(list(extra))


def ok(ttft, latency, out, start=0.0, itl=()):
    return RequestResult(success=True, start=start, ttft=ttft, latency=latency, output_len=out, prompt_len=10,
                         itl=list(itl), text="x", token_times=[start + ttft + sum(itl[:i]) for i in range(len(itl) + 1)])


def test_summary_keys_and_values():
    results = [
        ok(0.1, 1.1, 11, itl=[0.1] * 10),  # tpot 100 ms
        ok(0.3, 2.3, 21, start=0.5, itl=[0.1] * 20),  # tpot 100 ms
        RequestResult(error="http_503"),
        RequestResult(error="truncated_stream"),
        RequestResult(error="http_503"),
    ]
    s = summarize(args("--goodput", "ttft:200", "--metric-percentiles", "50,99", "--percentile-metrics", "ttft,tpot,e2el"),
                  results, duration=4.0)
    assert (s["completed"], s["failed"], s["num_prompts"]) == (2, 3, 5)
    assert s["failure_breakdown"] == {"http_503": 2, "truncated_stream": 1}
    assert s["total_output_tokens"] == 32 and s["output_throughput"] == 8.0 and s["request_throughput"] == 0.5
    assert s["total_token_throughput"] == (20 + 32) / 4.0
    assert s["median_ttft_ms"] == pytest.approx(200) and s["mean_tpot_ms"] == pytest.approx(100)
    assert s["p99_ttft_ms"] == pytest.approx(298, abs=0.1) and s["p50_e2el_ms"] == pytest.approx(1700)
    assert "p99_itl_ms" not in s and s["mean_itl_ms"] == pytest.approx(100)
    assert s["request_goodput"] == 1 / 4.0  # only the first meets TTFT <= 200 ms
    assert all(t <= e for t, e in zip(s["ttfts"], s["e2els"]))
    assert s["max_concurrent_requests"] == 2


def test_server_deltas_count_route_fallbacks_by_reason():
    empty, timeout = 'pdserve_route_fallbacks_total{reason="index_empty"}', 'pdserve_route_fallbacks_total{reason="index_timeout"}'
    deltas = server_deltas({empty: 1.0, timeout: 2.0}, {empty: 4.0, timeout: 2.0})
    assert deltas["route_fallbacks"] == 3
    assert deltas["route_fallbacks_index_empty"] == 3 and "route_fallbacks_index_timeout" not in deltas


def test_server_deltas_give_each_tiers_mean_decode_step_over_the_run():
    """From the gateway's own /metrics text: only the decode-only steps taken during the
    run count, per tier; a tier that took none has no figure."""
    steps = {"prefill": StepTimes(), "decode": StepTimes()}
    metrics = GatewayMetrics("gw")

    def scraped():
        stats = {tier: {"w0": {"running": 0, "waiting": 0, "kv_usage": 0.0, "step_seconds": t.snapshot()}}
                 for tier, t in steps.items()}
        return parse_metrics(metrics.render(stats, {"prefill": 0, "decode": 0}).decode())

    steps["decode"].observe(1, 0, 5.0)  # before the run
    before = scraped()
    steps["decode"].observe(2, 0, 0.020)
    steps["decode"].observe(2, 0, 0.030)
    steps["decode"].observe(2, 64, 0.500)  # mixed: not a decode step
    steps["prefill"].observe(0, 64, 0.100)  # prompt only
    deltas = server_deltas(before, scraped())
    assert deltas["decode_decode_step_mean_ms"] == pytest.approx(25.0)
    assert "prefill_decode_step_mean_ms" not in deltas


def test_server_deltas_give_the_hand_offs_mean_over_the_run():
    """The decode tier's `handoff` phase from the gateway's /metrics text, only what the run
    added; a run without hand-offs has no figure."""
    phases = Histograms(tracing.PHASES["decode"])
    metrics = GatewayMetrics("gw")

    def scraped():
        stats = {"decode": {"w0": {"running": 0, "waiting": 0, "kv_usage": 0.0, "phase_seconds": phases.snapshot()}}}
        return parse_metrics(metrics.render(stats, {"prefill": 0, "decode": 0}).decode())

    phases.observe_as("handoff", 9.0)  # before the run
    before = scraped()
    assert "handoff_mean_ms" not in server_deltas(before, scraped())
    phases.observe_as("handoff", 0.060)
    phases.observe_as("handoff", 0.100)
    phases.observe_as("kv_receive", 3.0)  # another phase
    deltas = server_deltas(before, scraped())
    assert deltas["handoffs"] == 2 and deltas["handoff_mean_ms"] == pytest.approx(80.0)


def test_goodput_flag_is_checked():
    assert goodput_slos(["ttft:100", "e2el:2000"]) == {"ttft": 100.0, "e2el": 2000.0}
    with pytest.raises(ValueError):
        goodput_slos(["itl:5"])


def test_attainment_counts_failures_as_misses():
    result = {"ttfts": [0.1, 0.1, 0.5], "e2els": [1.1, 5.1, 1.5], "output_lens": [11, 11, 11], "completed": 3, "failed": 1}
    assert attainment(result, slo_ttft_ms=200, slo_tpot_ms=150) == 1 / 4


def test_throughput_over_time_spreads_tokens_over_deltas():
    r = ok(0.5, 2.0, 6, itl=[0.6, 0.6])  # 3 deltas of 2 tokens at 0.5, 1.1, 1.7 s
    assert throughput_over_time([r], 0.0) == [2.0, 4.0]


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_arrivals_have_the_requested_rate_and_spread(burstiness, cv):
    times = np.array(arrival_times(20_000, rate=5.0, burstiness=burstiness, seed=1))
    assert times[-1] == pytest.approx(20_000 / 5.0)  # the mean rate, exactly
    gaps = np.diff(times, prepend=0.0)
    assert (gaps >= 0).all() and gaps.mean() == pytest.approx(0.2)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)  # gamma: CV = 1 / sqrt(shape)
    assert arrival_times(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_times(5, 2.0, burstiness, 7) == arrival_times(5, 2.0, burstiness, 7)  # seeded


def test_skewed_prefix_repetition_and_interference_prompts(tiny_llama):
    tokenizer = Tokenizer.from_pretrained(tiny_llama)
    a = args("--dataset-name", "prefix_repetition", "--num-prompts", "20", "--prefix-repetition-num-prefixes", "4",
             "--prefix-repetition-prefix-len", "24", "--prefix-repetition-suffix-len", "8", "--prefix-repetition-hot-fraction", "0.8",
             "--interference-input-len", "40")
    requests = datasets.load(a, tokenizer)
    heads = [r.prompt[:16] for r in requests]
    hot = max(set(heads), key=heads.count)
    assert heads.count(hot) == 16 + 1  # 80% share the first prefix; the rest cycle through all four (one more of it)
    long = datasets.interference_requests(a, tokenizer, count=3)
    assert len(long) == 3 and all(abs(r.prompt_len - 40) <= 2 for r in long) and all(r.output_len == 2 for r in long)


@pytest.mark.parametrize(("spec", "want"), [
    ("colocated", LocalTarget(0, 1, None, None)),
    ("2colocated@1", LocalTarget(0, 2, None, 1)),
    ("colocated:round_robin@2", LocalTarget(0, 1, "round_robin", 2)),
    ("1p2d", LocalTarget(1, 2, None, None)),
    ("2p1d:kv_aware@1", LocalTarget(2, 1, "kv_aware", 1)),
    ("1p1d@1/auto", LocalTarget(1, 1, None, 1, engine_cores="auto")),
    ("1p1d@1/own", LocalTarget(1, 1, None, 1, engine_cores="own")),
    ("colocated/shared", LocalTarget(0, 1, None, None, engine_cores="shared")),
])
def test_local_targets_name_replicas_routing_threads_and_cores(spec, want):
    assert local_target(spec) == want
    assert parse_target(spec) == spec


@pytest.mark.parametrize(("spec", "want"), [("offline", OfflineTarget(None)), ("offline@2", OfflineTarget(2))])
def test_the_offline_target_names_its_threads(spec, want):
    assert offline_target(spec) == want and local_target(spec) is None
    assert parse_target(spec) == spec


@pytest.mark.parametrize("spec", ["0colocated", "0p1d", "1p0d", "colocated@", "2x1p1d", "p1d", "1p1d/mine", "1p1d/own@1",
                                  "offline@0", "offline@", "offline/own", "2offline"])
def test_a_malformed_target_is_refused_with_the_grammar(spec):
    assert local_target(spec) is None and offline_target(spec) is None
    with pytest.raises(ValueError, match="colocated"):
        parse_target(spec)
