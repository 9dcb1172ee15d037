"""Structured outputs without a model: the constraint's validation (what the edge refuses),
the compiled-grammar cache, the bitmask's unpacking and the sampler under a grammar's mask
(cluster/engine/structured_outputs.py, cluster/engine/grammar.py, cluster/engine/sampler.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cluster.engine.grammar import GrammarCompiler, allowed_tokens, bitmask_words
from cluster.engine.sampler import SampleInput, Sampler, make_generator
from cluster.engine.sampling_params import SamplingParams as SP
from cluster.engine.structured_outputs import MAX_SPEC_CHARS, StructuredOutputs
from cluster.errors import InvalidRequestError
from cluster.model.builtin import builtin_model_path
from cluster.model.checkpoints import open_checkpoint


@pytest.fixture(scope="module")
def tokenizer():
    return open_checkpoint(builtin_model_path()).tokenizer()


@pytest.fixture
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (lambda: StructuredOutputs.json_schema({"type": "foo"}), "Invalid type: foo"),
        (lambda: StructuredOutputs.json_schema("{not json"), "not JSON"),
        (lambda: StructuredOutputs.json_schema([1, 2]), "must be an object"),
        (lambda: StructuredOutputs("regex", spec="a(b"), "unclosed group"),
        (lambda: StructuredOutputs("grammar", spec="start: undefined_rule"), "unknown name"),
        (lambda: StructuredOutputs("choice", choices=()), "choice must be"),
        (lambda: StructuredOutputs("choice", choices=("a", "")), "choice must be"),
        (lambda: StructuredOutputs("regex", spec="a" * (MAX_SPEC_CHARS + 1)), f"the limit is {MAX_SPEC_CHARS}"),
        (lambda: StructuredOutputs("yaml"), "kind must be one of"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_with_the_reason(spec, says):
    with pytest.raises(InvalidRequestError, match=says):
        spec().validate()


def test_an_engine_refuses_a_grammar_that_does_not_compile(compiler):
    """The engine compiles what reaches it (the edge validated it; an engine does not trust that)."""
    with pytest.raises(InvalidRequestError, match="unclosed group"):
        compiler.constraint(StructuredOutputs("regex", spec="a(b"))
    assert compiler.compiles == 0


def test_a_grammar_over_the_size_limit_is_refused_before_compiling():
    """Each alternative is valid; their number is what costs: refused by llguidance's limit."""
    huge = "start: " + " | ".join(f'"w{i}"' for i in range(40_000))
    spec = StructuredOutputs("grammar", spec=huge[:MAX_SPEC_CHARS].rsplit("|", 1)[0])
    spec.validate()  # under the character limit and the grammar limit: fine
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,40}(x|y){1,30}"} for i in range(2000)}}
    with pytest.raises(InvalidRequestError):
        StructuredOutputs.json_schema(schema).validate()


def test_json_schema_property_order_is_kept():
    spec = StructuredOutputs.json_schema({"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}})
    assert list(json.loads(spec.spec)["properties"]) == ["zeta", "alpha"]


def test_a_repeated_grammar_compiles_once_and_each_request_gets_its_own_matcher(compiler, tokenizer):
    spec = StructuredOutputs("choice", choices=("yes", "no"))
    first, second = compiler.constraint(spec), compiler.constraint(StructuredOutputs("choice", choices=("yes", "no")))
    assert compiler.compiles == 1
    assert first.advance(tokenizer.encode("yes", add_special_tokens=False)) and first.done
    assert not second.done and second.accepts(tokenizer.encode("no", add_special_tokens=False)[0])
    compiler.constraint(StructuredOutputs("choice", choices=("maybe",)))
    assert compiler.compiles == 2


def test_a_refused_token_is_reported_not_consumed_silently(compiler, tokenizer):
    c = compiler.constraint(StructuredOutputs("regex", spec="[0-9]+"))
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not c.accepts(letter)
    assert not c.advance([letter]) and c.error


def test_the_bitmask_unpacks_to_exactly_the_tokens_the_matcher_allows(compiler, tokenizer):
    vocab = 49152
    c = compiler.constraint(StructuredOutputs("choice", choices=("Paris", "London", "Rome")))
    bitmask = torch.empty((1, bitmask_words(vocab)), dtype=torch.int32)
    c.fill(bitmask[0])
    allowed = allowed_tokens(bitmask, vocab)[0]
    words = bitmask.numpy().view(np.uint32)[0]
    expected = [t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1]
    assert allowed.nonzero().flatten().tolist() == expected
    firsts = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Paris", "London", "Rome")}
    assert firsts <= set(expected) and len(expected) < 100


def test_the_mask_bits_map_to_token_ids_little_endian():
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    bitmask[0, 0] = 1 - 2**31  # bits 0 and 31 (the sign bit): tokens 0 and 31
    bitmask[1, 1] = 1 << 3  # token 35
    allowed = allowed_tokens(bitmask, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31]
    assert allowed[1].nonzero().flatten().tolist() == [35]


def _allowed(vocab: int, ids) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[list(ids)] = True
    return mask


@pytest.mark.parametrize("params", [SP(temperature=0.0), SP(temperature=1.0, top_k=5), SP(temperature=1.3, top_p=0.9, min_p=0.05)])
def test_a_constrained_row_only_samples_allowed_tokens_and_others_are_untouched(params):
    torch.manual_seed(0)
    vocab = 500
    logits = torch.randn(3, vocab) * 3
    allowed = {7, 123, 499}
    free = SampleInput(params, [], [], make_generator(1))
    out = []
    for seed in range(40):
        rows = [
            SampleInput(params, [], [], make_generator(seed), allowed=_allowed(vocab, allowed)),
            SampleInput(params, [], [], make_generator(1)),
            SampleInput(params, [], [], make_generator(seed), allowed=_allowed(vocab, allowed)),
        ]
        sampled = Sampler()(logits, rows)
        assert {sampled[0].token_id, sampled[2].token_id} <= allowed
        out.append(sampled[1].token_id)
    # The free row draws what it draws alone: the masks of its neighbours changed nothing.
    alone = Sampler()(logits[1:2], [free])[0].token_id
    assert set(out) == {alone}


def test_greedy_under_a_mask_takes_the_best_allowed_token_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    out = Sampler()(logits, [SampleInput(SP(temperature=0.0, logprobs=1), [], [], allowed=_allowed(4, {2, 3}))])[0]
    assert out.token_id == 2
    assert out.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 2]))  # of the raw logits, as OpenAI's
    assert out.top[0][0] == 0


def test_a_grammar_that_allows_only_banned_tokens_wins_over_min_tokens():
    """Its end before min_tokens: eos is banned but it is all the grammar allows."""
    logits = torch.zeros(2, 10)
    eos = 9
    rows = [
        SampleInput(SP(temperature=0.0), [], [], banned_token_ids=(eos, eos), allowed=_allowed(10, {eos})),
        SampleInput(SP(temperature=0.0), [], [], banned_token_ids=(eos,), allowed=_allowed(10, {3, eos})),
    ]
    assert [t.token_id for t in Sampler()(logits, rows)] == [eos, 3]
