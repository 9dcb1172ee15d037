"""A request resumed after tokens another worker streamed (mid-stream migration) goes on
exactly where that worker stopped: the same next tokens, and text that joins without a
repeated or missing character, also when the cut falls inside a partial stop string."""

import pytest

from cluster.config import CacheConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError

PROMPT = "The quick brown fox jumps over the lazy dog, again and again, until"


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine.from_pretrained(str(tiny_models["llama"]), dtype="float32", max_model_len=256, cache=CacheConfig(num_blocks=64))


def stream(engine: Engine, params: SamplingParams, generated=()) -> list[tuple[list[int], str, str | None]]:
    """(tokens, text, finish reason) of each delta, as a client receives them."""
    rid = engine.add_request(PROMPT, params, generated=generated)
    deltas = []
    while engine.has_unfinished:
        deltas += [(o.new_token_ids, o.new_text, o.finish_reason) for o in engine.step() if o.request_id == rid]
    assert engine.pool.num_used_blocks == 0
    return deltas


def test_resumed_text_and_tokens_join_the_undisturbed_stream(engine):
    free = stream(engine, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    text = "".join(t for _, t, _ in free)
    assert len(text) > 12
    # A stop string that the output reaches late: deltas before it hold back its prefix.
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[text[-8:-3]])
    whole = stream(engine, params)
    tokens = [t for ids, _, _ in whole for t in ids]
    assert whole[-1][2] == "stop" and len(tokens) > 4
    for k in range(1, len(tokens)):
        resumed = stream(engine, params, generated=tuple(tokens[:k]))
        assert [t for ids, _, _ in resumed for t in ids] == tokens[k:]
        assert "".join(t for _, t, _ in whole[:k] + resumed) == "".join(t for _, t, _ in whole)
        assert resumed[-1][2] == "stop"


def test_resuming_past_the_end_is_refused(engine):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(InvalidRequestError):
        engine.add_request(PROMPT, params, generated=(1, 2, 3))
    with pytest.raises(InvalidRequestError):
        engine.add_request(PROMPT, params, generated=(10**9,))
    assert not engine.has_unfinished
