"""Prefill on one engine, decode on another, KV blocks copied between them: the same
tokens as one colocated engine. This is the data path the workers run, minus Ray and
the network (blocks are copied directly between the two engines' caches here)."""

import asyncio
import dataclasses
import threading

import pytest

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams

BS = 8


def make_engine(model_dir, kv_cache_dtype: str = "auto"):
    return Engine.from_pretrained(
        str(model_dir),
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(block_size=BS, num_blocks=96, dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),
    )


def copy_blocks(src: Engine, src_ids, dst: Engine, dst_ids):
    for (sk, sv), (dk, dv) in zip(src.runner.kv_caches, dst.runner.kv_caches):
        dk[dst_ids] = sk[src_ids]
        dv[dst_ids] = sv[src_ids]


def prefill(engine: Engine, prompt, params, generated=()) -> tuple[str, int]:
    """Run the prompt (and the tokens already generated) for its next token, keeping its
    blocks: (request id, that token). Its finished output names the blocks it holds."""
    rid = engine.add_request(prompt, params.for_first_token(len(generated)), hold_kv=True, generated=generated)
    token = None
    while token is None:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                token = out.new_token_ids[0]
                assert out.finished and out.held_block_ids == engine.block_table(rid) and out.held_block_ids
    return rid, token


def disaggregated(p_engine: Engine, d_engine: Engine, prompt, params, kv_received=True, generated=()):
    rid, first = prefill(p_engine, prompt, params, generated)
    reserved = d_engine.add_remote_request(d_engine.inputs.process(prompt, params), generated=generated)
    assert reserved is not None
    drid, dst_ids, num_cached = reserved
    # The first token streams before the KV arrives; the request then waits for it.
    out = d_engine.accept_first_token(drid, first)
    assert out.new_token_ids == [first] and d_engine.step() == []
    tokens = list(out.new_token_ids)
    src_ids = p_engine.block_table(rid)[num_cached // BS :]
    assert len(src_ids) == len(dst_ids)
    if kv_received:
        copy_blocks(p_engine, src_ids, d_engine, dst_ids)
    assert p_engine.release(rid)
    if out.finished:  # its first token ended it: the held blocks go once the copy is done
        d_engine.abort(drid)
        return tokens, num_cached, len(dst_ids)
    assert d_engine.commit_remote(drid, kv_received)
    while not out.finished:
        for out in d_engine.step():
            tokens += out.new_token_ids
            assert out.held_block_ids is None  # its blocks are the decode engine's own now
            d_engine.check_integrity()
    return tokens, num_cached, len(dst_ids)


PROMPTS = [
    "A short one",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up and",
    "The quick brown fox jumps over the lazy dog, again and again, until the fox gets tired of",
]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_disaggregated_tokens_equal_colocated(tiny_models, params, kv_cache_dtype):
    model = tiny_models["qwen3"]
    expected = [c.token_ids for c in make_engine(model, kv_cache_dtype).generate(PROMPTS, params)]
    p_engine, d_engine = make_engine(model, kv_cache_dtype), make_engine(model, kv_cache_dtype)
    moved = []
    for prompt, want in zip(PROMPTS, expected):
        tokens, num_cached, num_moved = disaggregated(p_engine, d_engine, prompt, params)
        assert tokens == want
        moved.append((num_cached, num_moved))
    # The third prompt shares a long prefix with the second: the decode engine already
    # holds those blocks and fewer are moved.
    assert moved[2][0] > 0 and moved[2][1] < moved[1][1]
    for e in (p_engine, d_engine):
        e.check_integrity()
        assert e.pool.num_used_blocks == 0


def test_kv_sent_chunk_by_chunk_gives_the_tokens_one_send_gives(tiny_models):
    """A stream_kv prefill reports each chunk's KV (tokens computed, blocks) as it goes:
    the full blocks copied as each report comes, the rest at the first token, land the
    same KV in the decode engine as one copy at the end, hence the same tokens."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    model = tiny_models["qwen3"]
    prompt = PROMPTS[1]  # in chunks of 8 tokens (max_num_batched_tokens), as the blocks are
    want = make_engine(model).generate([prompt], params)[0].token_ids
    p_engine, d_engine = make_engine(model), make_engine(model)
    p_engine.scheduler.config = dataclasses.replace(p_engine.scheduler.config, max_num_batched_tokens=8)
    p_engine.step_budget.max_tokens = 8
    drid, dst_ids, num_cached = d_engine.add_remote_request(d_engine.inputs.process(prompt, params))
    rid = p_engine.add_request(prompt, params.for_first_token(0), hold_kv=True, stream_kv=True)
    copied, reports, first = 0, [], None
    while first is None:
        for out in p_engine.step():
            assert out.request_id == rid
            if out.kv_progress is not None:
                computed, table = out.kv_progress
                assert out.new_token_ids == [] and not out.finished and table == p_engine.block_table(rid)
                reports.append(computed)
                full = computed // BS
                copy_blocks(p_engine, table[copied:full], d_engine, dst_ids[copied:full])  # this chunk's full blocks
                copied = full
            else:
                first = out.new_token_ids[0]
                copy_blocks(p_engine, out.held_block_ids[copied:], d_engine, dst_ids[copied:])  # the rest
    n = out.num_prompt_tokens
    assert n > 16 and reports == list(range(8, n, 8))  # after each chunk that did not sample; the last one's output is the token
    out = d_engine.accept_first_token(drid, first)
    assert d_engine.commit_remote(drid, True) and p_engine.release(rid)
    tokens = list(out.new_token_ids)
    while d_engine.has_unfinished:
        for out in d_engine.step():
            tokens += out.new_token_ids
    assert tokens == want
    for e in (p_engine, d_engine):
        e.check_integrity()
        assert e.pool.num_used_blocks == 0


def test_failed_transfer_recomputes_to_the_same_tokens(tiny_models):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    model = tiny_models["llama"]
    expected = make_engine(model).generate([PROMPTS[1]], params)[0].token_ids
    p_engine, d_engine = make_engine(model), make_engine(model)
    tokens, _, _ = disaggregated(p_engine, d_engine, PROMPTS[1], params, kv_received=False)
    assert tokens == expected
    assert d_engine.pool.num_used_blocks == 0 and p_engine.pool.num_used_blocks == 0


def test_abort_releases_held_and_reserved_blocks(tiny_llama):
    p_engine, d_engine = make_engine(tiny_llama), make_engine(tiny_llama)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    rid, _ = prefill(p_engine, PROMPTS[1], params)
    assert p_engine.pool.num_used_blocks > 0
    p_engine.abort(rid)  # the decode side went away: the held blocks return
    drid, _, _ = d_engine.add_remote_request(d_engine.inputs.process(PROMPTS[1], params))
    assert d_engine.pool.num_used_blocks > 0
    d_engine.abort(drid)
    for e in (p_engine, d_engine):
        e.check_integrity()
        assert e.pool.num_used_blocks == 0


def test_first_token_that_ends_the_request_frees_blocks_only_after_the_transfer(tiny_llama):
    """A first token that is a stop token ends the request at once (the client sees the
    finish before the KV arrives); the reserved blocks stay held, since the receive still
    writes them, until the worker aborts after it."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    first_greedy = make_engine(tiny_llama).generate([PROMPTS[1]], greedy)[0].token_ids[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[first_greedy])
    p_engine, d_engine = make_engine(tiny_llama), make_engine(tiny_llama)
    rid, first = prefill(p_engine, PROMPTS[1], params)
    assert first == first_greedy
    drid, _, _ = d_engine.add_remote_request(d_engine.inputs.process(PROMPTS[1], params))
    out = d_engine.accept_first_token(drid, first)
    assert out.finished and out.finish_reason == "stop" and out.new_text == ""
    assert d_engine.pool.num_used_blocks > 0  # held: the transfer may still write them
    assert not d_engine.commit_remote(drid, True)  # it never joins the batch
    d_engine.abort(drid)  # what the worker does once the receive is over
    p_engine.abort(rid)
    for e in (p_engine, d_engine):
        e.check_integrity()
        assert e.pool.num_used_blocks == 0


def test_the_prefills_first_token_respects_min_tokens(tiny_llama):
    """min_tokens bans stop tokens from the first token on the prefill worker too."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    first_greedy = make_engine(tiny_llama).generate([PROMPTS[2]], greedy)[0].token_ids[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=2, stop_token_ids=[first_greedy])
    expected = make_engine(tiny_llama).generate([PROMPTS[2]], params)[0].token_ids
    assert expected[0] != first_greedy  # banned there ...
    tokens, _, _ = disaggregated(make_engine(tiny_llama), make_engine(tiny_llama), PROMPTS[2], params)
    assert tokens == expected  # ... and here


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, frequency_penalty=0.5),
])
def test_a_migrated_request_resumes_with_the_same_tokens(tiny_models, params):
    """A request re-issued after k streamed tokens (its decode worker died) goes through
    prefill and decode again and continues with exactly the tokens the undisturbed run
    produced (seeded sampling and output penalties included)."""
    model = tiny_models["qwen3"]
    want = make_engine(model).generate([PROMPTS[1]], params)[0].token_ids
    p_engine, d_engine = make_engine(model), make_engine(model)
    for k in (1, 4, len(want) - 1):
        tokens, _, _ = disaggregated(p_engine, d_engine, PROMPTS[1], params, generated=tuple(want[:k]))
        assert tokens == want[k:]
    for e in (p_engine, d_engine):
        e.check_integrity()
        assert e.pool.num_used_blocks == 0


def test_a_lost_prefill_is_computed_on_the_decode_engine(tiny_llama):
    """The prefill worker died before its reply: the reserved request computes its prompt
    and first token locally, in the blocks it reserved, to the same tokens."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = make_engine(tiny_llama).generate([PROMPTS[2]], params)[0].token_ids
    d_engine = make_engine(tiny_llama)
    rid, _, _ = d_engine.add_remote_request(d_engine.inputs.process(PROMPTS[2], params))
    assert not d_engine.commit_remote(rid, True)  # no first token accepted: not a commit
    assert d_engine.compute_here(rid)
    tokens = []
    while d_engine.has_unfinished:
        for out in d_engine.step():
            tokens += out.new_token_ids
    assert tokens == want
    d_engine.check_integrity()
    assert d_engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("kv_in_before_the_first_token", [True, False])
def test_a_request_whose_kv_is_in_joins_the_batch_with_its_first_token(tiny_llama, kv_in_before_the_first_token):
    """Through AsyncEngine (as the decode worker runs it): the KV in when the first token
    is accepted, the request joins the batch in that same call; otherwise when the
    receiving thread says the KV is in (kv_in). Both give the colocated tokens and free
    every block."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (want,) = [c.token_ids for c in make_engine(tiny_llama).generate([PROMPTS[1]], params)]
    p_engine, d_engine = make_engine(tiny_llama), make_engine(tiny_llama)
    rid, first_token = prefill(p_engine, PROMPTS[1], params)
    aengine = AsyncEngine(lambda: d_engine)
    arrived = threading.Event()

    async def decode() -> tuple[list[int], bool]:
        request = d_engine.inputs.process(PROMPTS[1], params)
        drid, dst_ids, num_cached = await aengine.call(lambda e: e.add_remote_request(request))

        def receive():  # the receiving thread: the blocks, then the event, then the join
            copy_blocks(p_engine, p_engine.block_table(rid)[num_cached // BS :], d_engine, dst_ids)
            arrived.set()
            aengine.kv_in(drid, True)

        if kv_in_before_the_first_token:
            receive()
        first, decoded, joined_with_first = await aengine.accept_first_token(drid, first_token, None, kv_arrived=arrived.is_set)
        if not joined_with_first:
            await asyncio.to_thread(receive)
        return list(first.new_token_ids) + [t async for out in decoded for t in out.new_token_ids], joined_with_first

    try:
        tokens, joined_with_first = asyncio.run(decode())
    finally:
        aengine.shutdown()
    assert tokens == want and joined_with_first == kv_in_before_the_first_token
    assert p_engine.release(rid) and d_engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("ending", ["received", "failed", "aborted"])
def test_a_request_waiting_for_its_kv_joins_when_told_and_only_then(tiny_llama, ending):
    """A first token accepted before the KV: the request waits outside the batch until
    kv_in. Received, it decodes the colocated tokens; failed (policy recompute), it
    recomputes its prompt here to the same tokens; aborted while it waits, a late kv_in
    joins nothing. Every block comes back."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (want,) = [c.token_ids for c in make_engine(tiny_llama).generate([PROMPTS[1]], params)]
    p_engine, d_engine = make_engine(tiny_llama), make_engine(tiny_llama)
    rid, first_token = prefill(p_engine, PROMPTS[1], params)
    aengine = AsyncEngine(lambda: d_engine)

    async def decode() -> list[int] | None:
        request = d_engine.inputs.process(PROMPTS[1], params)
        drid, dst_ids, num_cached = await aengine.call(lambda e: e.add_remote_request(request))
        first, decoded, joined = await aengine.accept_first_token(drid, first_token, None, kv_arrived=lambda: False)
        assert not joined and await aengine.call(lambda e: e.num_unfinished) == 1
        if ending == "aborted":
            aengine.abort(drid)
            aengine.kv_in(drid, True)  # too late: nothing to join
            assert await aengine.call(lambda e: (e.num_unfinished, e.pool.num_used_blocks)) == (0, 0)
            return None
        if ending == "received":
            copy_blocks(p_engine, p_engine.block_table(rid)[num_cached // BS :], d_engine, dst_ids)
        aengine.kv_in(drid, ending == "received")
        return list(first.new_token_ids) + [t async for out in decoded for t in out.new_token_ids]

    try:
        tokens = asyncio.run(decode())
    finally:
        aengine.shutdown()
    assert tokens == (None if ending == "aborted" else want)
    assert p_engine.release(rid) and d_engine.pool.num_used_blocks == 0
