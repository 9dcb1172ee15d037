from cluster.engine.step_times import BUCKETS_S, StepTimes


def test_steps_are_counted_by_kind_in_cumulative_buckets():
    t = StepTimes()
    t.observe(8, 0, 0.004)  # decode, first bucket
    t.observe(8, 0, 0.2)  # decode, <= 0.25
    t.observe(0, 512, 7.0)  # prompt, +Inf
    t.observe(8, 64, 0.05)  # mixed, <= 0.05 (bounds are inclusive)
    s = t.snapshot()
    assert s["decode"]["buckets"][0] == 1 and s["decode"]["buckets"][BUCKETS_S.index(0.25)] == 2
    assert s["decode"]["buckets"][-1] == 2 and abs(s["decode"]["sum"] - 0.204) < 1e-9
    assert s["prompt"]["buckets"][-2] == 0 and s["prompt"]["buckets"][-1] == 1
    assert s["mixed"]["buckets"][BUCKETS_S.index(0.05) - 1] == 0 and s["mixed"]["buckets"][BUCKETS_S.index(0.05)] == 1
