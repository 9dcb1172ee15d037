r"""The block pool: the only owner of KV block ids.

Every block is in exactly one region at all times:

    +-----------+----------------------+-------------------------+
    |  in use   |     cached-idle      |          free           |
    | ref_cnt>0 | ref_cnt==0, hashed   | ref_cnt==0, no hash     |
    +-----------+----------------------+-------------------------+
                 \_______ idle queue (LRU: front is reused first) _/

    in_use + cached_idle + free == num_blocks          (check_integrity)

Idle blocks (cached or not) wait in one LRU queue. Allocation takes from its front;
a cached block taken that way is evicted (its hash forgotten, an `evicted` event
recorded). A prefix hit `touch`es cached blocks, pulling idle ones out of the queue.
`free` appends blocks to the back in the order given, so callers free a request's
blocks tail-first: the end of a prefix is evicted before its start.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from cluster.kv.hashing import BlockHash


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_cnt = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Net change per hash since the last take_events() (True: now cached, False: now
        # gone), for the prefix index; a later change of a hash overrides an earlier one.
        self._changes: dict[BlockHash, bool] = {}

    # ---- queries -------------------------------------------------------------
    @property
    def num_idle_blocks(self) -> int:
        """Blocks an allocation can take now (free + cached-idle)."""
        return len(self._idle)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._idle)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash_of[block_id]

    def cached_prefix(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        """Block ids of the longest prefix of `block_hashes` held in the cache."""
        hit: list[int] = []
        if not self.enable_caching:
            return hit
        for h in block_hashes:
            block_id = self._block_of.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def num_idle_among(self, block_ids: Iterable[int]) -> int:
        return sum(1 for b in block_ids if self._ref_cnt[b] == 0)

    # ---- mutations -----------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the idle queue (evicting cached ones)."""
        if n > len(self._idle):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._idle)} idle")
        out = []
        for _ in range(n):
            block_id, _ = self._idle.popitem(last=False)
            self._forget_hash(block_id)
            self._ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._idle[block_id]
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks reaching zero join the idle queue's back."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._idle[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that in-use `block_id` holds the full block named `block_hash`.

        Returns False if another block already holds that hash (two requests computed
        the same prefix concurrently): the first one stays the cached copy.
        """
        if not self.enable_caching or self._hash_of[block_id] is not None:
            return False
        if block_hash in self._block_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        self._changes[block_hash] = True
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every hash of idle blocks (e.g. after a weight reload)."""
        for block_id in list(self._idle):
            self._forget_hash(block_id)

    def take_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, evicted): the net change since the last call. A hash stored and then
        evicted in between is only `evicted` (its removal is harmless to repeat); one
        evicted and stored again is only `stored`."""
        changes, self._changes = self._changes, {}
        return [h for h, cached in changes.items() if cached], [h for h, cached in changes.items() if not cached]

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash held now (in use or idle): the authoritative snapshot."""
        return list(self._block_of)

    def _forget_hash(self, block_id: int) -> None:
        h = self._hash_of[block_id]
        if h is not None:
            self._hash_of[block_id] = None
            del self._block_of[h]
            self._changes[h] = False

    # ---- invariants ----------------------------------------------------------
    def check_integrity(self, expected_refs: Sequence[int] | None = None) -> None:
        """Assert the region invariant; optionally that ref counts equal `expected_refs`
        (e.g. counted from every live request's block table)."""
        in_use = sum(1 for r in self._ref_cnt if r > 0)
        idle_cached = sum(1 for b in self._idle if self._hash_of[b] is not None)
        idle_free = len(self._idle) - idle_cached
        assert in_use + idle_cached + idle_free == self.num_blocks, (in_use, idle_cached, idle_free)
        assert all(r >= 0 for r in self._ref_cnt), "negative ref count"
        assert all(self._ref_cnt[b] == 0 for b in self._idle), "referenced block in idle queue"
        assert len(self._block_of) == sum(h is not None for h in self._hash_of), "hash maps disagree"
        for h, b in self._block_of.items():
            assert self._hash_of[b] == h, f"block {b} hash mismatch"
        if expected_refs is not None:
            assert list(expected_refs) == self._ref_cnt, "ref counts differ from live block tables"
