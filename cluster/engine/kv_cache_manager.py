"""Per-request block tables on top of the BlockPool.

The scheduler asks three things: how much of a request's prefix is already cached,
whether slots for N more tokens fit (all-or-nothing), and to release a request. It
gets block ids back only as opaque tables to hand to the model runner.
"""

from __future__ import annotations

from cluster.engine.request import Request
from cluster.kv.block_pool import BlockPool
from cluster.kv.hashing import hash_prefix_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a prefix-cache hit may cover: at least the last token is computed."""
    return (num_tokens - 1) // block_size


class KVCacheManager:
    def __init__(self, pool: BlockPool, model_id: str):
        self.pool = pool
        self.block_size = pool.block_size
        self.model_id = model_id
        self._tables: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}  # leading table entries already offered to the cache

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chain hashes to cover every full block of its tokens."""
        num_full = request.num_tokens // self.block_size
        done = len(request.block_hashes)
        if num_full > done:
            parent = request.block_hashes[-1] if done else None
            request.block_hashes.extend(
                hash_prefix_blocks(
                    request.token_slice(done * self.block_size, num_full * self.block_size),
                    self.block_size,
                    self.model_id,
                    request.cache_salt,
                    parent=parent,
                )
            )

    def cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """(block ids, tokens) of the longest cached prefix, leaving >= 1 token to compute."""
        self.update_block_hashes(request)
        max_blocks = num_reusable_blocks(request.num_tokens, self.block_size)
        hit = self.pool.cached_prefix(request.block_hashes[:max_blocks])
        return hit, len(hit) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` after the request's computed (or cached) tokens.

        `cached_blocks` (first admission only) are referenced and become the head of the
        table. Returns False, changing nothing, if the pool cannot supply the blocks.
        """
        table = self._tables.get(request.request_id, [])
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else request.num_computed_tokens
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(cached_blocks)
        # Idle cached blocks we are about to reference leave the allocatable set too.
        available = self.pool.num_idle_blocks - self.pool.num_idle_among(cached_blocks)
        if need > available:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            table = list(cached_blocks)
        if need > 0:
            table = table + self.pool.allocate(need)
        self._tables[request.request_id] = table
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish every full block whose KV is now computed to the prefix cache."""
        self.update_block_hashes(request)
        table = self._tables.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(table))
        for i in range(self._num_published.get(request.request_id, 0), num_full):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_published[request.request_id] = max(num_full, self._num_published.get(request.request_id, 0))

    def free(self, request: Request) -> None:
        """Release the request's blocks tail-first (so a prefix's end is evicted first)."""
        table = self._tables.pop(request.request_id, [])
        self._num_published.pop(request.request_id, None)
        self.pool.free(reversed(table))

    def expected_ref_counts(self) -> list[int]:
        refs = [0] * self.pool.num_blocks
        for table in self._tables.values():
            for b in table:
                refs[b] += 1
        return refs

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.expected_ref_counts())
