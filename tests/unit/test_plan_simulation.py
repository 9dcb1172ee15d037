"""The planner's simulation (cluster/planner/simulate.py) against figures computed by hand
from a profile, the real SloPlanner driving simulated replicas, `pdserve plan`'s command
line, and the profile file and the planner's seed."""

import json
import math

import pytest

from cluster.cli import main
from cluster.planner.costs import EngineCosts
from cluster.planner.policy import SloPlanner
from cluster.planner.profile import Profile
from cluster.planner.simulate import Simulation
from cluster.planner.sizing import Split
from cluster.planner.workload import Phase, TraceRequest, builtin_trace

A, B = 0.010, 0.001  # decode step: A + B x running
C, D = 0.020, 0.002  # prompt step: C + D x tokens (+ B x running)
COSTS = EngineCosts(decode_base_s=A, decode_per_seq_s=B, prompt_base_s=C, prompt_per_token_s=D, chunk_tokens=512)
HANDOFF, OVERHEAD, START = 0.005, 0.003, 4.0


def profile(**changes) -> Profile:
    fields = dict(prefill=COSTS, decode=COSTS, decode_step_slowdown=1.2, colocated_step_slowdown=2.0,
                  colocated_min_prompt_chunk=32, replica_start_s=START, handoff_s=HANDOFF, overhead_s=OVERHEAD)
    return Profile(**{**fields, **changes})


def run(requests, split=Split(1, 1), colocated=False, **changes):
    trace = [TraceRequest(t, "p", prompt, output) for t, prompt, output in requests]
    return Simulation(profile(**changes), trace, split, colocated=colocated).run()


def test_one_request_disaggregated_takes_its_prompt_its_hand_off_and_its_decode_steps():
    (r,) = run([(1.0, 100, 5)]).requests
    prefill_end = 1.0 + C + D * 100
    assert r.first_token == pytest.approx(prefill_end + OVERHEAD)
    # It joins the decode batch once its KV is in, then 4 steps alone.
    assert r.finish == pytest.approx(prefill_end + HANDOFF + 4 * (A + B) + OVERHEAD)


def test_prompts_share_a_prefill_step_up_to_its_chunk_then_wait_their_turn():
    # a starts a step alone; b and c arrive during it: the next step takes b's 200 tokens and
    # c's first 312 (the chunk is 512), the one after c's last 88.
    a, b, c = run([(0.0, 300, 1), (0.001, 200, 1), (0.001, 400, 1)]).requests
    first = C + D * 300
    assert a.first_token == pytest.approx(first + OVERHEAD)
    assert b.first_token == pytest.approx(first + C + D * 512 + OVERHEAD)
    assert c.first_token == pytest.approx(first + C + D * 512 + C + D * 88 + OVERHEAD)
    assert all(r.finish == r.first_token for r in (a, b, c))  # one token: done at the first


def test_a_decode_batch_steps_together_until_its_shorter_request_ends():
    # b and c arrive as a's prompt step runs, share the next prefill step (20 tokens), and
    # join the decode batch together (a, with one token to decode, is long gone): steps of
    # A + 2B until b ends, then A + B.
    _, b, c = run([(0.0, 10, 2), (0.001, 10, 3), (0.001, 10, 6)]).requests
    kv_in = (C + D * 10) + (C + D * 20) + HANDOFF
    assert b.finish == pytest.approx(kv_in + 2 * (A + 2 * B) + OVERHEAD)
    assert c.finish == pytest.approx(kv_in + 2 * (A + 2 * B) + 3 * (A + B) + OVERHEAD)


def test_many_steps_at_once_give_what_one_at_a_time_would():
    # A long decode, and a second request arriving in the middle of its steps: the first's
    # steps are A + B until the newcomer joins at the boundary after its KV is in, then A + 2B.
    first, second = run([(0.0, 10, 201), (1.0, 10, 2)]).requests
    kv_in = C + D * 10 + HANDOFF
    second_kv_in = 1.0 + C + D * 10 + HANDOFF
    steps_alone = math.ceil((second_kv_in - kv_in) / (A + B))  # the boundary at or after its KV
    joined = kv_in + steps_alone * (A + B)
    assert second.finish == pytest.approx(joined + (A + 2 * B) + OVERHEAD)
    assert first.finish == pytest.approx(joined + (A + 2 * B) + (200 - steps_alone - 1) * (A + B) + OVERHEAD)


def test_without_a_prefill_replica_prompts_take_the_decode_engines_step_budget():
    # A decode running when a 400-token prompt arrives: each step beside it takes at most
    # (s - 1) x (A + B) / D prompt tokens: 1.2 -> 1 token (floor 1) ... 2.0 -> 5 (floor 32).
    def prompt_time(colocated):
        _, late = run([(0.0, 10, 400), (1.0, 400, 2)], split=Split(0, 1), colocated=colocated).requests
        return late.first_token - 1.0

    protected, colocated = prompt_time(False), prompt_time(True)
    assert colocated == pytest.approx(400 / 32 * (C + 32 * D + B), rel=0.05)  # 32-token chunks, beside the decode
    assert protected > 4 * colocated  # decode protection: the prompt crawls beside the decodes


def test_the_planner_moves_a_decode_heavy_load_to_two_decode_replicas_after_a_replica_start():
    # Short prompts, long answers: one decode replica's ITL would be ~110 ms, two ~40 ms.
    requests, _ = builtin_trace(120.0, seed=0, phases=(Phase("long answers", 1.0, 0.8, 48, 256),))
    sim = Simulation(profile(decode=EngineCosts(0.02, 0.004, C, D, 512)), requests, Split(1, 1))
    sim.planner = SloPlanner(ttft_ms=2000, itl_ms=60, bounds=dict(min_prefill=0, max_prefill=1, min_decode=1, max_decode=2,
                                                                  budget=2), tiers={"prefill": "P", "decode": "D"},
                             step_slowdown=1.2, downscale_s=0, clock=lambda: sim.now)
    result = sim.run()
    moved_at = next(t for t, split in result.decisions if split == "0P2D")  # (while the load rose: 0P1D first)
    serving = [(p, d) for t, p, d in result.samples if moved_at < t < moved_at + START]
    assert serving and all(pd == (0, 1) for pd in serving)  # the second decode replica is starting
    assert (0, 2) in [(p, d) for t, p, d in result.samples if moved_at + START <= t < moved_at + START + 2.5]


def test_a_day_at_scale_follows_the_load_and_meets_the_slos(tmp_path):
    """64 replicas' worth of budget under the built-in day (an hour per 15 s): the planner
    sizes the tiers up and down with the load and meets the SLOs for most requests (the
    misses are at the hours where the mix changes, where a replica's start is a long
    time in a 15-second hour)."""
    costs = EngineCosts(decode_base_s=0.015, decode_per_seq_s=0.0002, prompt_base_s=0.01, prompt_per_token_s=0.0003,
                        chunk_tokens=2048)  # (a GPU's, roughly)
    prof, out = tmp_path / "profile.json", tmp_path / "day"
    profile(prefill=costs, decode=costs, replica_start_s=5.0).save(prof)
    assert main(["plan", "--profile", str(prof), "--simulate", "--day", "40", "--phase-s", "15", "--targets", "planner",
                 "--prefill-max-replicas", "32", "--decode-max-replicas", "32", "--budget", "64", "--slo-ttft-ms", "2000",
                 "--slo-itl-ms", "60", "--result-dir", str(out)]) == 0
    result = json.loads((out / "plan-simulated.json").read_text())["targets"]["planner"]
    counts = [p + d for t, p, d in result["replicas"] if t >= 15]  # (after the first hour: it starts at 1P1D)
    assert max(counts) > 16 and max(counts) >= 3 * min(counts)
    assert result["attainment"] >= 0.9
    assert (out / "plan-simulated.png").stat().st_size > 0


def test_plan_for_a_steady_load_prints_every_split_and_its_choice(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    profile().save(prof)
    assert main(["plan", "--profile", str(prof), "--rate", "1", "--prompt-len", "100", "--output-len", "50"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["split", "cost", "TTFT", "ms", "ITL", "ms"]
    assert [line.split()[0] for line in lines[1:]] == ["0P1D", "0P2D", "1P1D", "1P2D"]
    assert sum("<- chosen" in line for line in lines) == 1


def test_a_bad_profile_is_one_line_and_a_profile_seeds_the_planner(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"prefill": {}}')
    assert main(["plan", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a replica profile" in err and len(err.splitlines()) == 1
    planner = SloPlanner(ttft_ms=1000, itl_ms=50, bounds=dict(min_prefill=0, max_prefill=1, min_decode=1, max_decode=1,
                                                              budget=2), tiers={"prefill": "P", "decode": "D"},
                         step_slowdown=1.2, seed_costs=profile().costs())
    assert planner._known_costs["decode"] == COSTS


def test_a_one_token_answer_leaves_its_decode_replica_expecting_nothing():
    sim = Simulation(profile(), [TraceRequest(0.0, "p", 10, 1), TraceRequest(0.5, "p", 10, 3)], Split(1, 1))
    sim.run()
    (decode,) = sim.replicas["decode"]
    assert decode.coming == 0 and decode.held == 0  # (else its steps would wait on every event of the cluster)
