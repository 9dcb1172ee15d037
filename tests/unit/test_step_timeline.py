import time

import pytest

from cluster.bench.decode_timeline import alone_medians, attribute
from cluster.engine.step_timeline import StepTimeline


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_step_records_its_time_its_cpu_and_the_gap_only_while_requests_run():
    line = StepTimeline(max_steps=3)
    before = time.time()
    began = line.begin()
    _busy(0.01)
    line.end(began, decode=4, prompt=0, still_running=True)
    time.sleep(0.05)  # the engine thread away between two steps of running requests
    began = line.begin()
    time.sleep(0.02)  # off its core inside the step
    line.end(began, decode=4, prompt=32, still_running=False)
    time.sleep(0.02)  # idle: nothing ran, so no gap is counted
    line.end(line.begin(), decode=1, prompt=0, still_running=True)
    first, second, third = line.since(before)
    # (two clocks, read one after the other: the thread's can run a few microseconds past the wall's)
    assert first.step_s >= first.cpu_s - 1e-4 and first.cpu_s >= 0.009 and first.between_s == 0.0
    assert second.between_s >= 0.05 and second.step_s - second.cpu_s >= 0.019 and second.prompt == 32
    assert third.between_s == 0.0
    assert line.since(third.t) == [third]
    line.end(line.begin(), decode=1, prompt=0, still_running=True)
    assert len(line.since(0.0)) == 3 and line.since(0.0)[0] == second  # a ring: the oldest goes


def _step(decode, prompt=0, step_s=0.010, cpu_s=None, between_s=0.0):
    return {"t": 0.0, "step_s": step_s, "cpu_s": step_s if cpu_s is None else cpu_s, "between_s": between_s,
            "decode": decode, "prompt": prompt}


def test_slow_steps_are_put_down_to_their_causes_against_the_alone_median_of_their_batch():
    alone = {"d": [_step(4, step_s=0.010)] * 5 + [_step(8, step_s=0.020)] * 5 + [_step(4, prompt=64, step_s=0.5)]}
    medians = alone_medians(alone)
    assert medians == {4: pytest.approx(0.010), 8: pytest.approx(0.020)}  # prompt steps are no baseline
    beside = {"d": [
        _step(4, step_s=0.0115),  # within 1.2x: not slow
        _step(4, prompt=32, step_s=0.100),  # prompt work: all its excess
        _step(4, step_s=0.010, between_s=0.030),  # the engine thread away between steps
        _step(8, step_s=0.060, cpu_s=0.020),  # off its core: 40 ms of its 40 ms excess
        _step(6, step_s=0.030),  # batch 6 against batch 4's median: longer compute
        _step(0, prompt=512, step_s=2.0),  # no decodes in it: no one's ITL
    ]}
    a = attribute(beside, medians)
    assert a["decode_steps"] == 5 and a["slow_steps"] == 4
    assert a["slow_steps_by_cause"] == {"prompt_work": 1, "outside_steps": 1, "waited": 1, "compute": 1}
    assert a["excess_s_by_cause"] == {"prompt_work": pytest.approx(0.090), "outside_steps": pytest.approx(0.030),
                                      "waited": pytest.approx(0.040), "compute": pytest.approx(0.020)}
    assert a["p99_interval_ms"] == pytest.approx(100.0)
