"""Scheduler without a model: exact chunks, block ids, preemption and stop rules."""

from cluster.config import SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.kv.block_pool import BlockPool

BS = 4


def make(num_blocks=16, budget=8, max_seqs=8, max_model_len=64, caching=True):
    kv = KVCacheManager(BlockPool(num_blocks, BS, caching), "m")
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv, max_model_len)


def req(rid, n, max_tokens=4, start=0, **kw):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=frozenset({2}))


def run_step(s: Scheduler, token=100):
    out = s.schedule()
    sampled = {c.request_id: token for c in out.chunks if c.sample}
    updates = s.update_from_output(out, sampled)
    s.check_integrity()
    return out, updates


def test_chunked_prefill_interleaves_with_decode():
    s = make(budget=8)
    s.add_request(req("a", 3))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.chunks[0].sample and out.chunks[0].block_ids == [0]
    s.add_request(req("b", 20, start=50))
    out, _ = run_step(s)
    # a decodes 1 token, b gets the remaining 7 of the budget as its first chunk.
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    b = next(c for c in out.chunks if c.request_id == "b")
    assert (b.start_pos, b.sample, b.block_ids) == (0, False, [1, 2])
    assert b.token_ids == list(range(50, 57))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    b = next(c for c in out.chunks if c.request_id == "b")
    assert (b.start_pos, b.block_ids) == (7, [1, 2, 4, 5])  # a took block 3 first
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}
    assert next(c for c in out.chunks if c.request_id == "b").sample
    assert s.requests["b"].output_token_ids == [100]


def test_fcfs_and_max_num_seqs():
    s = make(budget=64, max_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 4))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_frees_blocks_and_recomputes_later():
    # 4 blocks of 4 tokens. a and b each fill 2 blocks with their 8-token prompts.
    s = make(num_blocks=4, budget=64, max_model_len=16, caching=False)
    s.add_request(req("a", 8, max_tokens=6))
    s.add_request(req("b", 8, max_tokens=6, start=20))
    out, _ = run_step(s)
    assert s.kv.block_table("a") == [0, 1] and s.kv.block_table("b") == [2, 3]
    # Next step both need a 3rd block for token 9: a is first; b (admitted last) is preempted.
    out, _ = run_step(s)
    assert out.preempted_request_ids == ["b"]
    assert out.num_scheduled_tokens == {"a": 1}
    assert s.kv.block_table("a") == [0, 1, 3]  # b freed tail-first: 3 then 2; a took 3
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [100]  # kept: recompute replays prompt + outputs
    assert list(s.waiting) == [b]
    while s.requests.get("a"):
        run_step(s)
    # a finished (max_tokens): b is readmitted and recomputes all 9 known tokens at once.
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"b": 9}
    assert out.chunks[0].token_ids == list(range(20, 28)) + [100]
    while s.requests:
        run_step(s)
    assert s.kv.pool.num_used_blocks == 0


def test_prefix_cache_hit_skips_computed_blocks():
    s = make(budget=64)
    s.add_request(req("a", 10, max_tokens=1))
    run_step(s)
    assert "a" not in s.requests  # finished after 1 token; blocks cached-idle
    s.add_request(req("b", 11, max_tokens=1))
    out, _ = run_step(s)
    c = out.chunks[0]
    assert (c.start_pos, len(c.token_ids)) == (8, 3)
    assert c.block_ids[:2] == [0, 1]


def test_stop_rules():
    s = make(budget=64)
    s.add_request(req("eos", 3, max_tokens=5))
    s.add_request(req("min", 3, max_tokens=5, min_tokens=2, start=10))
    s.add_request(req("ign", 3, max_tokens=3, ignore_eos=True, start=20))
    s.add_request(req("stop_id", 3, max_tokens=5, stop_token_ids=(7,), start=30))
    _, updates = run_step(s, token=2)  # eos for everyone
    status = {u.request_id: u.status for u in updates}
    assert status["eos"] == RequestStatus.FINISHED_STOPPED
    assert status["min"] == RequestStatus.RUNNING  # min_tokens=2 not reached
    assert status["ign"] == RequestStatus.RUNNING
    assert status["stop_id"] == RequestStatus.FINISHED_STOPPED
    _, updates = run_step(s, token=7)
    status = {u.request_id: u.status for u in updates}
    assert status == {"min": RequestStatus.RUNNING, "ign": RequestStatus.RUNNING}
    _, updates = run_step(s, token=2)
    status = {u.request_id: u.status for u in updates}
    assert status["min"] == RequestStatus.FINISHED_STOPPED
    assert status["ign"] == RequestStatus.FINISHED_LENGTH
    assert not s.requests and s.kv.pool.num_used_blocks == 0


def test_finish_request_frees_waiting_and_running():
    s = make(budget=4)
    s.add_request(req("a", 8))
    s.add_request(req("b", 8, start=40))
    run_step(s)  # a has a partial prefill, b waits
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is None
    s.check_integrity()
    assert s.kv.pool.num_used_blocks == 0


def test_max_model_len_finishes_with_length():
    s = make(budget=64, max_model_len=6)
    s.add_request(req("a", 4, max_tokens=10))
    run_step(s)
    _, updates = run_step(s)
    assert updates[0].status == RequestStatus.FINISHED_LENGTH
    assert s.kv.pool.num_idle_blocks == s.kv.pool.num_blocks


def test_requests_waiting_for_kv_are_not_schedulable():
    """The engine thread sleeps while its only requests wait for KV (it must not spin)."""
    s = make()
    assert s.add_remote_request(req("r", 20)) is not None
    assert s.has_unfinished and not s.has_schedulable
    assert s.schedule().is_empty
    assert s.accept_remote_token("r", 7) is not None and not s.has_schedulable
    assert s.commit_remote("r", kv_received=True) and s.has_schedulable


def test_a_prompt_that_arrives_behind_a_long_one_starts_in_the_next_step():
    s = make(num_blocks=32, budget=16)
    s.add_request(req("long", 60))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"long": 16}  # nothing waits: the whole budget
    s.add_request(req("short", 6, start=100))
    out, _ = run_step(s)
    # The prompt in progress leaves the shorter waiting one its 6 tokens: it finishes its
    # prompt now instead of after the long prompt's three remaining chunks.
    assert out.num_scheduled_tokens == {"long": 10, "short": 6}
    assert next(c for c in out.chunks if c.request_id == "short").sample
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"long": 15, "short": 1}  # its decode keeps its token


def test_a_waiting_prompt_leaves_room_only_up_to_half_a_step_and_only_if_shorter():
    s = make(num_blocks=64, budget=16)
    s.add_request(req("long", 40))
    run_step(s)  # 24 left
    s.add_request(req("mid", 20, start=100))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"long": 8, "mid": 8}  # shorter, but room is half a step
    s2 = make(num_blocks=64, budget=16)
    s2.add_request(req("first", 40))
    run_step(s2)  # 24 left
    s2.add_request(req("longer", 30, start=100))
    out, _ = run_step(s2)
    # Not shorter than what the first has left: it waits its turn rather than sharing the
    # steps, which would delay both first tokens.
    assert out.num_scheduled_tokens == {"first": 16}


def test_no_room_is_left_for_a_waiting_prompt_that_cannot_be_admitted():
    s = make(num_blocks=64, budget=16, max_seqs=1)
    s.add_request(req("long", 40))
    run_step(s)
    s.add_request(req("short", 4, start=100))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"long": 16}  # max_num_seqs: it could not start anyway


def shared(rid, prefix_len, suffix_len, suffix_start, **kw):
    """A prompt of `prefix_len` tokens every such request shares, then its own suffix."""
    tokens = list(range(prefix_len)) + list(range(suffix_start, suffix_start + suffix_len))
    return Request(rid, tokens, SamplingParams(max_tokens=kw.pop("max_tokens", 4), **kw), eos_token_ids=frozenset({2}))


def test_a_burst_of_one_prefix_computes_it_once():
    s = make(num_blocks=64, budget=32)
    for i, rid in enumerate("abc"):
        s.add_request(shared(rid, 24, 4, 100 + 10 * i))
    out, _ = run_step(s)
    # b and c would compute the same 24 tokens again beside a: they wait for a's blocks.
    assert out.num_scheduled_tokens == {"a": 28}
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    out, _ = run_step(s)
    # The prefix is cached now (6 blocks): each computes its own suffix only.
    assert out.num_scheduled_tokens == {"a": 1, "b": 4, "c": 4}
    assert {c.request_id: c.start_pos for c in out.chunks} == {"a": 28, "b": 24, "c": 24}
    assert s.prefix_hit_tokens == 48


def test_a_request_waiting_for_a_prefix_in_progress_does_not_hold_back_the_others():
    s = make(num_blocks=64, budget=16)
    s.add_request(shared("a", 24, 4, 100))
    s.add_request(shared("b", 24, 4, 110))
    s.add_request(req("other", 6, start=200))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 16}
    out, _ = run_step(s)
    # b waits for a's blocks 4-5; "other", behind it, starts in the room a prompt in
    # progress leaves to a shorter one, and the queue keeps b ahead of anything later.
    assert out.num_scheduled_tokens == {"a": 10, "other": 6}
    assert [r.request_id for r in s.waiting] == ["b"]
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 2, "other": 1, "b": 4}  # b from the cached 24 tokens
    assert next(c for c in out.chunks if c.request_id == "b").start_pos == 24


def test_a_prefix_in_progress_that_is_aborted_lets_its_waiters_compute_it():
    s = make(num_blocks=64, budget=16)
    s.add_request(shared("a", 24, 4, 100))
    s.add_request(shared("b", 24, 4, 110))
    run_step(s)
    assert [r.request_id for r in s.waiting] == ["b"]
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(s)
    # a's 4 computed blocks stayed cached; b computes the rest itself, no one to wait for.
    assert out.num_scheduled_tokens == {"b": 12}
    assert out.chunks[0].start_pos == 16


def test_a_prompt_whose_kv_streams_computes_its_last_tail_tokens_in_a_chunk_of_their_own():
    """Only the last chunk's KV is still to send when the first token comes: a streamed
    prompt of more than twice the tail leaves its tail to the last step; any other
    prompt, and a short streamed one, takes the whole budget."""
    kv = KVCacheManager(BlockPool(64, BS, True), "m")
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32, stream_kv_tail_tokens=4), kv, 128)

    def streamed(rid, n, start):
        r = req(rid, n, max_tokens=1, start=start)
        r.stream_kv = True
        return r

    s.add_request(streamed("long", 20, 0))
    assert [run_step(s)[0].num_scheduled_tokens["long"] for _ in range(2)] == [16, 4]
    s.add_request(streamed("beyond_budget", 44, 30))  # the budget first, then all but the tail, then the tail
    assert [run_step(s)[0].num_scheduled_tokens["beyond_budget"] for _ in range(3)] == [32, 8, 4]
    s.add_request(streamed("short", 8, 80))  # not more than twice the tail: one chunk
    assert run_step(s)[0].num_scheduled_tokens == {"short": 8}
    s.add_request(req("local", 20, max_tokens=1, start=90))  # not streamed: one chunk
    assert run_step(s)[0].num_scheduled_tokens == {"local": 20}
