"""Engine behaviour through its public API on a real tiny checkpoint."""

import asyncio
import threading

import pytest
import torch

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.sampling_params import SamplingParams
from cluster.errors import InvalidRequestError
from cluster.model.loader import ModelLoadError


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.from_pretrained(
        str(tiny_llama),
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(block_size=8, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompt = "The quick brown fox"
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], p)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    batched = engine.generate(["other prompt", prompt, "third"], [others, p, others])[1].token_ids
    assert alone == batched
    other_seed = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=4321, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_stop_string_cuts_text_and_finishes(engine):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = engine.generate(["Hello world"], greedy)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]  # a stop string somewhere inside the output, maybe across tokens
    cut = engine.generate(["Hello world"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_stop_token_ids_and_min_tokens(engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = engine.generate(["abc"], greedy)[0].token_ids
    stop_at = full[4]
    first = full.index(stop_at)
    out = engine.generate(["abc"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: first + 1]
    out = engine.generate(
        ["abc"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at], min_tokens=first + 2)
    )[0]
    assert len(out.token_ids) >= first + 2
    # Before min_tokens the stop token cannot even be sampled (vLLM semantics).
    assert stop_at not in out.token_ids[: first + 2 - 1]


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ("x " * 300, SamplingParams(max_tokens=4), "maximum context length is 256"),
        ("hi", SamplingParams(max_tokens=256), "maximum context length"),
        ([10**9], SamplingParams(), "token ids must be integers"),
    ],
)
def test_bad_input_is_refused_before_any_work(engine, prompt, params, match):
    before = engine.pool.num_used_blocks
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished and engine.pool.num_used_blocks == before


def test_negative_max_tokens_is_refused():
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine.from_pretrained(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        Engine.from_pretrained(str(tmp_path))


def test_abort_frees_blocks(engine):
    rid = engine.add_request("some prompt to abort", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.pool.num_used_blocks > 0
    final = engine.abort(rid)
    assert final.finished and final.finish_reason == "abort"
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_async_stream_matches_batch_and_cancel_aborts(engine):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = engine.generate(["stream me"], greedy)[0]
    aengine = AsyncEngine(lambda: engine)

    async def collect():
        tokens, text, last = [], "", None
        async for delta in aengine.stream(engine.inputs.process("stream me", greedy)):
            tokens += delta.new_token_ids
            text += delta.new_text
            last = delta
        return tokens, text, last

    async def cancel_midway():
        agen = aengine.stream(engine.inputs.process("cancel me", SamplingParams(max_tokens=200, ignore_eos=True)))
        async for _ in agen:
            break
        await agen.aclose()  # consumer goes away: the request is aborted

    try:
        tokens, text, last = asyncio.run(collect())
        assert tokens == expected.token_ids and text == expected.text
        assert last.finished and last.finish_reason == "length"
        asyncio.run(cancel_midway())
        for _ in range(100):
            if not engine.has_unfinished:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert not engine.has_unfinished
    finally:
        aengine.shutdown()
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_async_engine_builds_its_engine_on_the_engine_thread(tiny_llama):
    """The thread that steps is the only one that ever ran the model (its OpenMP master:
    cluster/engine/async_engine.py), and a build that fails fails the constructor."""
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return Engine.from_pretrained(str(tiny_llama), dtype="float32", max_model_len=64,
                                      cache=CacheConfig(block_size=8, num_blocks=16))

    aengine = AsyncEngine(build)
    try:
        assert built_on == [aengine._thread] and built_on[0] is not threading.current_thread()
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

        async def collect():
            return [d async for d in aengine.stream(aengine.engine.inputs.process("hello", greedy))]

        deltas = asyncio.run(collect())
        assert sum(len(d.new_token_ids) for d in deltas) == 4 and deltas[-1].finish_reason == "length"
    finally:
        aengine.shutdown()
    with pytest.raises(ModelLoadError, match="does not exist"):
        AsyncEngine(lambda: Engine.from_pretrained("/nonexistent/model"))


def test_a_short_prompt_behind_a_long_one_gets_its_first_token_first(tiny_llama):
    """A prompt in progress leaves room in each step to a shorter one waiting behind it:
    the short prompt's first token comes before the long prompt's, and neither changes."""
    engine = Engine.from_pretrained(
        str(tiny_llama), dtype="float32", max_model_len=512,
        cache=CacheConfig(block_size=8, num_blocks=256, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=32),
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long_prompt, short_prompt = "the long prompt " * 60, "a short one"
    alone = {p: engine.generate([p], greedy)[0].token_ids for p in (long_prompt, short_prompt)}
    long_id = engine.add_request(long_prompt, greedy)
    assert not engine.step()  # its first chunk only: 240 prompt tokens take 8 steps
    short_id = engine.add_request(short_prompt, greedy)
    first_tokens, tokens = [], {long_id: [], short_id: []}
    while engine.has_unfinished:
        for out in engine.step():
            if out.new_token_ids and not tokens[out.request_id]:
                first_tokens.append(out.request_id)
            tokens[out.request_id] += out.new_token_ids
    assert first_tokens == [short_id, long_id]
    assert tokens == {long_id: alone[long_prompt], short_id: alone[short_prompt]}
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_a_burst_of_one_prefix_computes_it_once_and_changes_no_token(tiny_llama):
    """Prompts that share a prefix, added together, in a step budget that holds them all:
    the first computes the prefix, the others wait for its blocks and compute only their
    own suffixes, and each gets the tokens it gets alone."""
    def build(caching: bool) -> Engine:
        return Engine.from_pretrained(
            str(tiny_llama), dtype="float32", max_model_len=512,
            cache=CacheConfig(block_size=8, num_blocks=256, enable_prefix_caching=caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=512),
        )
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefix = "a system prompt every user of this app sends first " * 4
    prompts = [prefix + f"then question number {i}" for i in range(3)]
    alone = [out.token_ids for out in build(caching=False).generate(prompts, greedy)]
    engine = build(caching=True)
    ids = [engine.add_request(p, greedy) for p in prompts]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[i] for i in ids] == alone
    token_ids = [engine.inputs.process(p, greedy).prompt_token_ids for p in prompts]
    shared = next(n for n in range(len(token_ids[0])) if len({tuple(t[: n + 1]) for t in token_ids}) > 1)
    assert shared >= 40  # the test means something: a prefix of whole blocks
    assert engine.scheduler.prefix_hit_tokens == 2 * (shared // 8 * 8)  # the 2nd and 3rd each hit it
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_a_bf16_kv_cache_under_float32_holds_twice_the_tokens_and_chunks_and_prefixes_change_no_token(tiny_llama):
    """--kv-cache-dtype bfloat16 on a float32 model: the same memory holds twice the blocks,
    and since every attention reads a K/V row as stored (rounded once), a prompt computed in
    one step, in chunks, or after a cached prefix gives the same tokens."""
    def build(kv_dtype: str, chunk: int = 512, caching: bool = False) -> Engine:
        return Engine.from_pretrained(
            str(tiny_llama), dtype="float32", max_model_len=512,
            cache=CacheConfig(block_size=8, memory_gib=0.02, dtype=kv_dtype, enable_prefix_caching=caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
        )
    fp32, bf16 = build("auto"), build("bfloat16")
    assert (fp32.config.cache.dtype, bf16.config.cache.dtype) == ("float32", "bfloat16")
    assert bf16.config.cache.num_blocks // 2 == fp32.config.cache.num_blocks
    assert {t.dtype for pair in bf16.runner.kv_caches for t in pair} == {torch.bfloat16}
    assert (fp32.checked_stats()["kv_cache_dtype"], bf16.checked_stats()["kv_cache_dtype"]) == ("float32", "bfloat16")

    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prefix = "a system prompt every user of this app sends first " * 4
    prompts = [prefix + f"then question number {i}" for i in range(3)]
    one_step = [bf16.generate([p], greedy)[0].token_ids for p in prompts]
    assert [out.token_ids for out in build("bfloat16", chunk=24).generate(prompts, greedy)] == one_step
    cached = build("bfloat16", caching=True)
    assert [cached.generate([p], greedy)[0].token_ids for p in prompts] == one_step
    assert cached.scheduler.prefix_hit_tokens > 0  # the 2nd and 3rd prompts read the 1st's blocks
    for engine in (bf16, cached):
        engine.check_integrity()
        assert engine.pool.num_used_blocks == 0
