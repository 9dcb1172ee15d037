"""A request's phases (cluster/serving/tracing.py): each is timed into its tier's histogram
whether or not tracing is on, once, however it ends."""

import time

import pytest

from cluster.engine.step_times import BUCKETS_S, Histograms
from cluster.serving import tracing


def counts(histograms: Histograms, label: str) -> tuple[int, float]:
    snapshot = histograms.snapshot()[label]
    return snapshot["buckets"][-1], snapshot["sum"]


def test_a_phase_is_timed_with_tracing_off_and_a_plain_span_costs_nothing():
    assert not tracing.enabled()
    phases = Histograms(tracing.PHASES["decode"])
    with tracing.NO_SPAN.child("reserve", phases) as reserve:
        time.sleep(0.03)
    reserve.end()  # a second end observes nothing more
    n, seconds = counts(phases, "reserve")
    assert n == 1 and 0.03 <= seconds < 1.0
    assert snapshot_bucket(phases, "reserve", 0.05) == 1 and snapshot_bucket(phases, "reserve", 0.025) == 0
    assert tracing.NO_SPAN.child("reserve") is tracing.NO_SPAN  # no phase: nothing at all


def snapshot_bucket(histograms: Histograms, label: str, bound: float) -> int:
    return histograms.snapshot()[label]["buckets"][BUCKETS_S.index(bound)]


def test_a_failed_phase_counts_too_and_a_root_phase_times_itself():
    phases = Histograms(tracing.PHASES["prefill"])
    with pytest.raises(RuntimeError), tracing.NO_SPAN.child("kv_send", phases):
        raise RuntimeError("the receiver is gone")
    root = tracing.start("prefill", {}, phases)
    root.end()
    assert counts(phases, "kv_send")[0] == 1 and counts(phases, "prefill")[0] == 1
