"""`pdserve bench trace`'s workload and accounting without a cluster: the built-in phases,
a JSONL trace (and a broken one), what meets the SLOs, and replica-seconds."""

import json

import pytest

from cluster.bench.openai_client import RequestResult
from cluster.bench.plots import plot_trace
from cluster.bench.trace_summary import meets, predicted_over_observed, replica_seconds, summarize, switches
from cluster.planner.workload import BUILTIN, builtin_trace, load_trace


def test_the_builtin_trace_has_each_phase_at_its_rate_and_lengths():
    requests, phases = builtin_trace(phase_s=3000.0, seed=1)  # long enough for the counts to hold (the quiet phase: ~150)
    assert [name for name, _, _ in phases] == [p.name for p in BUILTIN]
    assert phases[-1][2] == pytest.approx(3000.0 * len(BUILTIN))
    for p, (name, lo, hi) in zip(BUILTIN, phases):
        inside = [r for r in requests if r.phase == name]
        assert all(lo <= r.t < hi and (r.prompt_len, r.output_len) == (p.prompt_len, p.output_len) for r in inside)
        assert len(inside) == pytest.approx(p.rate * (hi - lo), rel=0.35)  # Poisson (or burstier) around the rate
    assert builtin_trace(3000.0, seed=1) == (requests, phases)  # a seed replays the same trace


def test_a_jsonl_trace_is_read_in_time_order_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in (
        {"t": 5.0, "prompt_len": 10, "output_len": 3, "phase": "b"},
        {"t": 1.0, "prompt_len": 20, "output_len": 4, "phase": "a"},
        {"t": 2.5, "prompt_len": 30, "output_len": 5},
    )) + "\n")
    requests, phases = load_trace(str(path))
    assert [r.t for r in requests] == [1.0, 2.5, 5.0] and requests[1].phase == "all"
    assert dict((n, (lo, hi)) for n, lo, hi in phases) == {"a": (1.0, 1.0), "all": (2.5, 2.5), "b": (5.0, 5.0)}
    path.write_text('{"t": 1, "prompt_len": 5}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:1: a trace line needs t, prompt_len and output_len"):
        load_trace(str(path))


def test_slos_and_replica_seconds():
    fast = RequestResult(success=True, ttft=0.5, latency=0.5 + 9 * 0.05)
    assert meets(fast, 10, ttft_s=1.0, itl_s=0.06) and not meets(fast, 10, ttft_s=1.0, itl_s=0.04)
    assert not meets(fast, 10, ttft_s=0.4, itl_s=0.06)
    assert not meets(RequestResult(success=False), 10, 1.0, 1.0)
    assert meets(RequestResult(success=True, ttft=0.2, latency=0.2), 1, 1.0, 0.001)  # one token: no TPOT
    # 1P1D for 10 s, then 0P1D until the end at 30 s: 2 x 10 + 1 x 20.
    assert replica_seconds([(0.0, 1, 1), (10.0, 0, 1)], end_s=30.0) == pytest.approx(40.0)


def test_the_summary_and_its_plot(tmp_path):
    requests, phases = builtin_trace(phase_s=60.0, seed=0)
    results = [RequestResult(success=True, start=r.t, ttft=0.1 if r.phase != "long prompts" else 9.0,
                             latency=1.0) for r in requests]

    class Args:
        slo_ttft_ms, slo_itl_ms = 1000.0, 100.0

    s = summarize(requests, results, phases, [(0.0, 1, 1)], Args, threads=2)
    assert s["phases"]["long prompts"]["attainment"] == 0.0 and s["phases"]["chat"]["attainment"] == 1.0
    assert 0 < s["attainment"] < 1 and s["core_seconds"] == 2 * s["replica_seconds"] > 0
    result = {"cpu": "test", "slo_ttft_ms": 1000.0, "slo_itl_ms": 100.0, "phases": phases,
              "arrivals": [r.t for r in requests], "targets": {"1p1d@1": s}}
    assert plot_trace(result, tmp_path / "trace.png").stat().st_size > 10_000


def test_a_switch_lasts_until_the_split_asked_for_runs_and_a_superseded_one_never_ends():
    asked = [(0, 1, 1), (2, 0, 2), (4, 0, 2), (6, 0, 2), (8, 1, 1), (10, 0, 1), (12, 0, 1)]
    running = [(0, 1, 1), (2, 1, 1), (4, 0, 1), (6, 0, 2), (8, 0, 2), (10, 0, 2), (12, 0, 1)]
    assert switches(asked, running) == [
        {"t": 0, "to": "1P1D", "s": 0},
        {"t": 2, "to": "0P2D", "s": 4},  # the prefill replica stopped at once, the new decode one ran 4 s later
        {"t": 8, "to": "1P1D", "s": None},  # asked for 0P1D before it ran
        {"t": 10, "to": "0P1D", "s": 2},
    ]


def test_the_planner_s_predictions_are_compared_with_what_it_observed_over_each_phase_s_steady_half():
    figures = [{"t": t, "predicted_ttft_s": 1.0, "observed_ttft_s": 1.0 if t >= 50 else 4.0,
                "predicted_itl_s": 0.05, "observed_itl_s": None} for t in range(0, 200, 2)]
    ratios = predicted_over_observed(figures, [("a", 0.0, 100.0), ("b", 100.0, 200.0)])
    assert ratios == {"a": {"ttft": 1.0, "itl": None}, "b": {"ttft": 1.0, "itl": None}}  # (a's first half: not steady)
