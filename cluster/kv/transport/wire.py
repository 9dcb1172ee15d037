"""The header that goes before each part of a transfer (torch_dist.py): which transfer,
which blocks, the cache geometry both sides must share, and how the payload travels (on
the group, in a shared-memory slot, or not at all: the sender's failure notice).

    [magic, transfer_id, first, num_blocks, total, layers, block_size, kv_heads, head_dim,
     dtype, slot pid, slot index, slot capacity]            int64, 13 words
"""

from __future__ import annotations

import zlib

import torch

from cluster.kv.transport.packing import CacheGeometry

MAGIC = 0x4B565846  # "KVXF": the payload follows on the group
FAILED_MAGIC = 0x4B564641  # "KVFA": the sender could not send this transfer
SHM_MAGIC = 0x4B56534D  # "KVSM": the payload waits in a shared-memory slot
HEADER_FIELDS = ("magic", "transfer_id", "first", "num_blocks", "total", "num_layers", "block_size", "num_kv_heads", "head_dim",
                 "dtype")
NUM_BLOCKS = HEADER_FIELDS.index("num_blocks")  # the part's own count: the receiver reads it
CHECKED = len(HEADER_FIELDS)  # then the slot's (pid, index, capacity): shared memory only
HEADER_WORDS = CHECKED + 3


def tags(transfer_id: int) -> tuple[int, int]:
    """(header tag, payload tag): unique per transfer, so concurrent transfers of one pair
    match by id, not by the order the two sides post them in."""
    return 2 * transfer_id, 2 * transfer_id + 1


def dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())  # the same in every process


def header(
    transfer_id: int, first: int, n: int, total: int, geometry: CacheGeometry, magic: int = MAGIC,
    slot: tuple[int, int, int] = (0, 0, 0),
) -> torch.Tensor:
    g = geometry
    values = [magic, transfer_id, first, n, total, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, dtype_code(g.dtype),
              *slot]
    return torch.tensor(values, dtype=torch.int64, device=g.device)  # header: [13]


def header_mismatch(expected: torch.Tensor, got: torch.Tensor) -> str:
    pairs = zip(HEADER_FIELDS, expected.tolist(), got.tolist())
    return ", ".join(f"{name} {g} (expected {e})" for name, e, g in pairs if e != g)
