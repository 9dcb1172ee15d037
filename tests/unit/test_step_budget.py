"""The step budget: how much prompt work a step carries while requests decode."""

from cluster.config import SchedulerConfig
from cluster.engine.step_budget import StepBudget
from tests.unit.test_scheduler import make, req, run_step


def test_the_whole_budget_until_costs_are_known_or_nothing_decodes():
    b = StepBudget(2048, 2.0, floor=32)
    assert b.prompt_tokens(num_decoding=8) == 2048  # nothing learned yet
    b.observe(num_decode_tokens=8, num_prompt_tokens=0, seconds=0.050)
    assert b.prompt_tokens(8) == 2048  # no prompt cost yet
    b.observe(num_decode_tokens=0, num_prompt_tokens=500, seconds=0.500)  # 1 ms per prompt token
    assert b.prompt_tokens(num_decoding=0) == 2048  # nothing decodes: throughput wins


def test_a_step_with_decodes_stays_within_the_slowdown():
    b = StepBudget(2048, 2.0, floor=32)
    b.observe(8, 0, 0.050)  # a decode-only step: 50 ms
    b.observe(0, 500, 0.500)  # prompt work: 1 ms per token
    assert b.prompt_tokens(8) == 50  # 50 ms of prompt work on top of a 50 ms decode step: 2x
    b3 = StepBudget(2048, 3.0, floor=32)
    b3.observe(8, 0, 0.050)
    b3.observe(0, 500, 0.500)
    assert b3.prompt_tokens(8) == 100
    # Next to decodes prompt work costs what the mixed steps show, net of the decode part:
    # 3 ms per token here, and the budget follows it, not the cheaper prompt-only steps.
    for _ in range(3):
        b.observe(8, 20, 0.050 + 0.060)
    assert 16 <= (0.050 / b.prompt_token_s) <= 17 and b.prompt_tokens(8) == 32  # 16 allowed; the floor: 32
    assert StepBudget(2048, 0.0, floor=32).prompt_tokens(8) == 2048  # 0: off


def test_scheduler_caps_prompt_chunks_but_never_decodes():
    s = make(num_blocks=64, budget=64)
    s.add_request(req("d", 4, max_tokens=20))
    run_step(s)  # "d" prefilled: it decodes from now on
    s.add_request(req("p", 40, max_tokens=2, start=100))
    out = s.schedule(prompt_budget=8)
    assert out.num_scheduled_tokens == {"d": 1, "p": 8}  # the decode always runs; the prompt gets 8
    assert SchedulerConfig().max_step_slowdown == 2.0
