"""Tensor-parallel sharding: which slice of every weight, head and vocabulary row a rank
holds. Pure arithmetic, shared by the loader, the model and the KV transfer.

Megatron-style, over `size` ranks of one replica:

    q_proj, k_proj, v_proj   column-parallel: rank r holds its query heads and their KV heads
    o_proj, down_proj        row-parallel: the matching input columns; outputs are summed
                             across ranks (one all-reduce each)
    gate_proj, up_proj       column-parallel: 1/size of the intermediate rows
    embed_tokens, lm_head    vocab-parallel: ceil(V/size) rows each (the last rank's are
                             zero-padded to that count, so gathered logits line up)
    norms                    replicated

KV heads: with at least `size` KV heads, rank r holds KV heads [r*Hk/size, (r+1)*Hk/size);
with fewer (GQA with 1 KV head on 2 ranks), each rank holds the one KV head its query
heads read, so a KV head is replicated on size/Hk ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.model.checkpoint import Slice
from cluster.model.families import ModelArch


class ShardingError(ValueError):
    """The model cannot be split over this many ranks."""


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`: the model dimensions it holds."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    kv_head_start: int  # the first of them, in the model's KV head numbering
    intermediate_size: int
    vocab_start: int
    vocab_rows: int  # rows of this rank's embedding/LM-head shard (padded: equal on every rank)
    vocab_size: int  # the model's (unpadded) vocabulary

    @property
    def kv_heads(self) -> tuple[int, int]:
        """[start, stop) of the model's KV heads held here."""
        return self.kv_head_start, self.kv_head_start + self.num_kv_heads


def check_divisible(arch: ModelArch, size: int) -> None:
    if size < 1:
        raise ShardingError(f"tensor parallel size must be >= 1, got {size}")
    problems = []
    if arch.num_heads % size:
        problems.append(f"{arch.num_heads} attention heads")
    if arch.intermediate_size % size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    if arch.num_kv_heads % size and size % arch.num_kv_heads:
        problems.append(f"{arch.num_kv_heads} KV heads (neither divides the other)")
    if problems:
        raise ShardingError(f"cannot split {', '.join(problems)} over {size} tensor-parallel ranks")


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """[start, stop) of the KV heads rank `rank` of `size` holds (see the module doc)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank * num_kv_heads // size
    return head, head + 1


def shard_of(arch: ModelArch, rank: int, size: int) -> Shard:
    check_divisible(arch, size)
    kv_start, kv_stop = kv_heads_of(rank, size, arch.num_kv_heads)
    vocab_rows = -(-arch.vocab_size // size)
    return Shard(
        rank=rank,
        size=size,
        num_heads=arch.num_heads // size,
        num_kv_heads=kv_stop - kv_start,
        kv_head_start=kv_start,
        intermediate_size=arch.intermediate_size // size,
        vocab_start=rank * vocab_rows,
        vocab_rows=vocab_rows,
        vocab_size=arch.vocab_size,
    )


_COLUMN_HEADS = ("self_attn.q_proj.",)
_COLUMN_KV_HEADS = ("self_attn.k_proj.", "self_attn.v_proj.")
_COLUMN_MLP = ("mlp.gate_proj.", "mlp.up_proj.")
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def tensor_slice(name: str, arch: ModelArch, shard: Shard) -> Slice | None:
    """The part of checkpoint tensor `name` that `shard` holds; None: all of it."""
    if shard.size == 1:
        return None
    d = arch.head_dim
    if any(p in name for p in _COLUMN_HEADS):
        start = shard.rank * shard.num_heads * d
        return 0, start, start + shard.num_heads * d
    if any(p in name for p in _COLUMN_KV_HEADS):
        return 0, shard.kv_head_start * d, (shard.kv_head_start + shard.num_kv_heads) * d
    if "self_attn.o_proj.weight" in name:
        start = shard.rank * shard.num_heads * d
        return 1, start, start + shard.num_heads * d
    if any(p in name for p in _COLUMN_MLP):
        start = shard.rank * shard.intermediate_size
        return 0, start, start + shard.intermediate_size
    if "mlp.down_proj.weight" in name:
        start = shard.rank * shard.intermediate_size
        return 1, start, start + shard.intermediate_size
    if name in VOCAB_TENSORS:
        return 0, shard.vocab_start, min(shard.vocab_start + shard.vocab_rows, shard.vocab_size)
    return None


# ---- KV transfer between replicas of different TP sizes ---------------------------


@dataclass(frozen=True)
class HeadRoute:
    """One piece of a KV hand-off: KV heads [start, stop) from source rank `src` to
    destination rank `dst` (heads in the model's numbering)."""

    src: int
    dst: int
    start: int
    stop: int


def _holds(rank: int, size: int, num_kv_heads: int, head: int) -> bool:
    start, stop = kv_heads_of(rank, size, num_kv_heads)
    return start <= head < stop


def kv_routes(num_kv_heads: int, src_size: int, dst_size: int) -> list[HeadRoute]:
    """Who sends which KV heads to whom, from a replica of `src_size` ranks to one of
    `dst_size`: every destination rank gets exactly the heads it holds, each from one
    source rank that holds it. Where several source ranks hold a head (replicated KV
    heads), destinations are spread over them, so no source rank sends for all."""
    routes: list[HeadRoute] = []
    for dst in range(dst_size):
        lo, hi = kv_heads_of(dst, dst_size, num_kv_heads)
        for head in range(lo, hi):
            holders = [s for s in range(src_size) if _holds(s, src_size, num_kv_heads, head)]
            src = holders[dst % len(holders)]
            last = routes[-1] if routes else None
            if last is not None and last.src == src and last.dst == dst and last.stop == head:
                routes[-1] = HeadRoute(src, dst, last.start, head + 1)  # contiguous heads: one piece
            else:
                routes.append(HeadRoute(src, dst, head, head + 1))
    return routes
