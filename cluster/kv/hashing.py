"""THE block-hash function. Router and workers import this one module.

A block hash is H(parent hash, the block's token ids, model id, salt). Only full
blocks are hashed, so a hash names a whole prefix: equal hashes mean equal token
prefixes (up to a 128-bit collision). The encoding is fixed bytes fed to BLAKE2b,
so the result is the same in every process and never depends on PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes; hex() of it is the Redis-friendly form

ROOT_PARENT = b"\x00" * 16


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], model_id: str, salt: str = "") -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else ROOT_PARENT)
    for field in (model_id.encode(), salt.encode()):
        h.update(struct.pack("<I", len(field)))
        h.update(field)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def hash_prefix_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    salt: str = "",
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Chain hashes of every full block of `token_ids`, from block `start_block` on.

    `parent` is the hash of block `start_block - 1` when extending an existing chain.
    The trailing partial block (if any) is not hashed.
    """
    hashes: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], model_id, salt)
        hashes.append(parent)
    return hashes
