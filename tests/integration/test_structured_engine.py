"""Constrained decoding in the engine, on the built-in model (SmolLM2-135M-Instruct): outputs
match their constraint, a resumed request continues under its grammar exactly as if it had
never moved, and tokens the grammar refuses end the request with an error."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.engine.input_processor import TokenizedRequest
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_outputs import StructuredOutputs
from cluster.errors import InvalidRequestError
from cluster.model.builtin import builtin_model_path
from tests.helpers import step_to_end

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["English", "French", "German"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(str(builtin_model_path()), dtype="float32", max_model_len=1024, num_threads=2,
                                  cache=CacheConfig(block_size=16, num_blocks=256))


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def run(engine, prompt, params, generated=()) -> tuple[list[int], str, str]:
    rid = engine.add(TokenizedRequest(prompt, params), generated=generated)
    ids, text, reason = [], "", None
    while reason is None:
        for out in engine.step():
            if out.request_id == rid:
                ids += out.new_token_ids
                text += out.new_text
                reason = out.finish_reason
    return ids, text, reason


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_outputs_match_their_json_schema(engine, temperature):
    prompt = chat(engine, "Describe a person as JSON: name, age, languages.")
    params = SamplingParams(max_tokens=120, temperature=temperature, seed=11, structured=StructuredOutputs.json_schema(PERSON))
    for completion in engine.generate([prompt] * 3, params):
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), PERSON)
    engine.check_integrity()


def test_json_object_choice_and_regex_constrain_the_text(engine):
    prompt = chat(engine, "What is the capital of France?")
    outputs = engine.generate([prompt] * 3, [
        SamplingParams(max_tokens=100, temperature=0, structured=StructuredOutputs("json_object")),
        SamplingParams(max_tokens=10, temperature=0, structured=StructuredOutputs("choice", choices=("Lyon", "Paris", "Nice"))),
        SamplingParams(max_tokens=20, temperature=0, structured=StructuredOutputs("regex", spec=r"[A-Z][a-z]+, [0-9]{4}")),
    ])
    assert isinstance(json.loads(outputs[0].text), dict) and outputs[0].finish_reason == "stop"
    assert outputs[1].text in ("Lyon", "Paris", "Nice") and outputs[1].finish_reason == "stop"
    assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", outputs[2].text) and outputs[2].finish_reason == "stop"


def test_without_a_constraint_the_same_prompt_is_not_json(engine):
    """The constraint is what makes the JSON: the model left alone answers in prose (so the
    tests above could fail)."""
    completion = engine.generate([chat(engine, "What is the capital of France?")], SamplingParams(max_tokens=30, temperature=0))[0]
    with pytest.raises(ValueError):
        json.loads(completion.text)


@pytest.mark.parametrize("seed", [None, 5])
def test_a_resumed_request_replays_its_tokens_into_the_grammar_and_continues_identically(engine, seed):
    """What a migration or the prefill hand-off does: the tokens already streamed are
    replayed into a fresh matcher, never sampled again, and the rest is the same."""
    prompt = chat(engine, "Describe a person as JSON: name, age, languages.")
    params = SamplingParams(max_tokens=120, temperature=0.0 if seed is None else 0.8, seed=seed,
                            structured=StructuredOutputs.json_schema(PERSON))
    whole, text, reason = run(engine, prompt, params)
    assert reason == "stop" and len(whole) > 8
    for cut in (1, 5, len(whole) - 1):
        rest, rest_text, rest_reason = run(engine, prompt, params, generated=whole[:cut])
        assert whole[:cut] + rest == whole and rest_reason == "stop"
    engine.check_integrity()


def test_generated_tokens_the_grammar_refuses_are_an_error_not_a_free_continuation(engine):
    prompt = chat(engine, "Pick a number.")
    params = SamplingParams(max_tokens=10, temperature=0, structured=StructuredOutputs("regex", spec="[0-9]+"))
    letters = engine.tokenizer.encode("abc", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="break the request's regex constraint"):
        engine.add(TokenizedRequest(prompt, params), generated=letters)
    complete = engine.tokenizer.encode("42", add_special_tokens=False)
    choice = SamplingParams(max_tokens=10, temperature=0, structured=StructuredOutputs("choice", choices=("42",)))
    with pytest.raises(InvalidRequestError, match="grammar is complete"):
        engine.add(TokenizedRequest(prompt, choice), generated=complete)
    assert engine.num_unfinished == 0


def test_a_prefill_workers_first_token_is_checked_against_the_grammar(engine):
    """The decode side accepts the prefill side's first token only if its grammar does."""
    prompt = chat(engine, "Pick a number.")
    params = SamplingParams(max_tokens=10, temperature=0, structured=StructuredOutputs("regex", spec="[0-9]+"))
    reserved = engine.add_remote_request(TokenizedRequest(prompt, params))
    assert reserved is not None
    rid = reserved[0]
    letter = engine.tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(InvalidRequestError, match="breaks the request's regex constraint"):
        engine.accept_first_token(rid, letter)
    digit = engine.tokenizer.encode("7", add_special_tokens=False)[0]
    out = engine.accept_first_token(rid, digit)
    assert out is not None and out.new_token_ids == [digit] and not out.finished
    engine.abort(rid)
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_logprobs_and_n_choices_under_a_grammar(engine):
    prompt = chat(engine, "Yes or no?")
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=2,
                            structured=StructuredOutputs("choice", choices=("yes", "no")))
    outputs = engine.generate([prompt] * 4, [params] * 4)
    for completion in outputs:
        assert completion.text in ("yes", "no")
        assert all(lp.logprob is not None and len(lp.top) == 2 for lp in completion.logprobs)


def test_preempted_constrained_requests_recompute_and_answer_as_if_never_preempted(engine):
    """Preemption recomputes KV and keeps the output tokens, so the grammar's state stands."""
    questions = ["Describe a person.", "Describe a famous person.", "Describe a young person.", "Describe an old person."]
    prompts = [chat(engine, q + " Answer in JSON.") for q in questions]
    params = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutputs.json_schema(PERSON))
    expected = [c.token_ids for c in engine.generate(prompts, params)]
    tight = Engine.from_pretrained(str(builtin_model_path()), dtype="float32", max_model_len=224, num_threads=2,
                                   cache=CacheConfig(block_size=16, num_blocks=14), scheduler=SchedulerConfig(max_num_batched_tokens=64))
    ids = [tight.add(TokenizedRequest(p, params)) for p in prompts]
    requests = {rid: tight.scheduler.requests[rid] for rid in ids}
    got = step_to_end(tight)
    assert sum(r.num_preemptions for r in requests.values()) > 0
    assert [got[rid] for rid in ids] == expected
    assert tight.pool.num_used_blocks == 0


def test_a_grammar_that_outgrows_the_parser_mid_way_ends_its_request_with_why(engine):
    """Valid, and compiled, but 600 optional properties make llguidance's parser rows wider
    than its limit once generation starts: the request ends (abort) with the reason as its
    error, the client's to see; the engine and the other requests go on."""
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(600)}}
    wide = SamplingParams(max_tokens=12, temperature=0, structured=StructuredOutputs.json_schema(schema))
    wide.structured.validate()
    prompt = chat(engine, "JSON please.")
    broken = engine.add(TokenizedRequest(prompt, wide))
    fine = engine.add(TokenizedRequest(prompt, SamplingParams(max_tokens=12, temperature=0)))
    ends = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                ends[out.request_id] = out
    assert ends[broken].finish_reason == "abort"
    assert "json constraint failed" in ends[broken].error and "max is 2000" in ends[broken].error
    assert ends[fine].finish_reason == "length" and ends[fine].error is None
    engine.check_integrity()
