"""Block pool and KV cache manager: exact block ids, ref counts, LRU eviction order."""

import pytest

from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.request import Request
from cluster.engine.sampling_params import SamplingParams
from cluster.kv.block_pool import BlockPool, NoFreeBlocksError
from cluster.kv.hashing import hash_prefix_blocks

BS = 4


def hashes(tokens, salt=""):
    return hash_prefix_blocks(tokens, BS, "m", salt)


def test_allocate_takes_lowest_ids_first_and_free_appends_in_order():
    pool = BlockPool(6, BS)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([4, 3])  # tail-first
    # idle queue is now 5, 4, 3
    assert pool.allocate(3) == [5, 4, 3]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_double_free_is_refused():
    pool = BlockPool(2, BS)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_cached_blocks_survive_free_and_are_evicted_lru():
    pool = BlockPool(4, BS)
    h = hashes(list(range(12)))  # 3 full blocks
    blocks = pool.allocate(3)  # [0, 1, 2]
    for b, hh in zip(blocks, h):
        assert pool.cache_block(b, hh)
    pool.free(reversed(blocks))  # idle queue: 3, 2, 1, 0
    assert pool.cached_prefix(h) == [0, 1, 2]
    pool.check_integrity()
    assert pool.num_cached_blocks == 3
    # Allocating 2 takes 3 (never cached) then 2 (the prefix's tail): tail evicted first.
    assert pool.allocate(2) == [3, 2]
    assert pool.cached_prefix(h) == [0, 1]
    stored, evicted = pool.take_events()
    assert stored == h[:2] and evicted == [h[2]]  # net change: h[2] was stored, then evicted
    assert pool.take_events() == ([], [])
    assert sorted(pool.cached_hashes()) == sorted(h[:2])
    # Evicted and stored again in one window: stored.
    (b,) = pool.allocate(1)
    pool.cache_block(b, h[2])
    pool.free([b])
    pool.reset_prefix_cache()
    (b,) = pool.allocate(1)
    pool.cache_block(b, h[2])
    stored, evicted = pool.take_events()
    assert stored == [h[2]] and sorted(evicted) == sorted(h[:2])
    pool.check_integrity()


def test_touch_pulls_idle_cached_block_out_of_queue():
    pool = BlockPool(3, BS)
    h = hashes(list(range(4)))
    (b,) = pool.allocate(1)
    pool.cache_block(b, h[0])
    pool.free([b])
    assert pool.num_idle_blocks == 3
    pool.touch([b])
    assert pool.ref_count(b) == 1 and pool.num_idle_blocks == 2
    assert pool.allocate(2) == [1, 2]  # block 0 is in use, not evictable
    pool.check_integrity()


def test_duplicate_hash_keeps_first_copy():
    pool = BlockPool(3, BS)
    h = hashes(list(range(4)))[0]
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert pool.block_hash(b) is None


def _req(rid, tokens, salt=""):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def test_manager_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    pool = BlockPool(10, BS)
    kv = KVCacheManager(pool, "m")
    r1 = _req("a", range(10))  # 2 full blocks + 2 tokens
    assert kv.cached_prefix(r1) == ([], 0)
    assert kv.allocate_slots(r1, 10)
    assert kv.block_table("a") == [0, 1, 2]
    r1.num_computed_tokens = 10
    kv.cache_computed_blocks(r1)
    assert pool.num_cached_blocks == 2

    r2 = _req("b", list(range(8)) + [99, 98, 97])
    blocks, n = kv.cached_prefix(r2)
    assert (blocks, n) == ([0, 1], 8)
    assert kv.allocate_slots(r2, 3, blocks)
    assert kv.block_table("b") == [0, 1, 3]
    assert pool.ref_count(0) == 2 and pool.ref_count(1) == 2
    kv.check_integrity()

    # An exact repeat of a block-aligned prompt must still compute its last token.
    r3 = _req("c", range(8))
    blocks, n = kv.cached_prefix(r3)
    assert (blocks, n) == ([0], 4)

    kv.free(r1)
    kv.free(r2)
    assert pool.num_used_blocks == 0
    kv.check_integrity()


def test_salt_separates_caches():
    pool = BlockPool(10, BS)
    kv = KVCacheManager(pool, "m")
    r1 = _req("a", range(9), salt="tenant-1")
    kv.allocate_slots(r1, 9)
    r1.num_computed_tokens = 9
    kv.cache_computed_blocks(r1)
    assert kv.cached_prefix(_req("b", range(9), salt="tenant-2")) == ([], 0)
    assert kv.cached_prefix(_req("c", range(9), salt="tenant-1"))[1] == 8


def test_allocate_slots_is_all_or_nothing():
    pool = BlockPool(3, BS)
    kv = KVCacheManager(pool, "m")
    r = _req("a", range(13))  # needs 4 blocks
    assert not kv.allocate_slots(r, 13)
    assert kv.block_table("a") == [] and pool.num_idle_blocks == 3
    assert kv.allocate_slots(r, 12)
    assert kv.block_table("a") == [0, 1, 2]
    kv.check_integrity()


def test_allocate_counts_idle_cached_hits_against_capacity():
    pool = BlockPool(3, BS)
    kv = KVCacheManager(pool, "m")
    r1 = _req("a", range(8))
    kv.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    kv.cache_computed_blocks(r1)
    kv.free(r1)  # blocks 0,1 cached-idle; idle queue: 2, 1, 0
    r2 = _req("b", list(range(4)) + list(range(50, 58)))  # hits block 0, needs 2 more
    blocks, n = kv.cached_prefix(r2)
    assert blocks == [0]
    # 3 idle blocks, but one is the hit itself: only 2 remain for new ones. Fits exactly.
    assert kv.allocate_slots(r2, 8, blocks)
    assert kv.block_table("b") == [0, 2, 1]
    assert pool.cached_prefix(hashes(list(range(8)))) == [0]  # block 1 was evicted
    kv.check_integrity()
