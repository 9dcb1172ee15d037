"""Decode attention over a paged KV cache: one query token per sequence.

Invariants: q is [B, Hq, D]; k_cache/v_cache are [num_blocks, block_size, Hk, D] with
Hq % Hk == 0 (query head h reads kv head h // (Hq // Hk)); block_tables is [B, max_blocks]
int32 and only its first cdiv(context_lens[b], block_size) entries of row b are read (the
rest is padding with any value); context_lens is [B] int32 and already counts the current
token, whose K/V is in the cache. Cache rows at positions >= context_lens[b] are never
used. The softmax is computed in fp32; the output is [B, Hq, D] in q.dtype. A sequence
with context_len 0 gets a zero output.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import cpu


@dataclass(frozen=True)
class DecodeGather:
    """Where each sequence's context lies in the cache, for the reference path: the same
    for every layer of a step, so the runner computes it once per step."""

    table: torch.Tensor  # [B, nb] int64: block ids up to the longest context, padding -> block 0
    live: torch.Tensor  # [B, nb * block_size] bool: position < context_len
    dead_rows: torch.Tensor  # indexes into the B * nb * block_size gathered rows that are not live


def decode_gather(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> DecodeGather | None:
    """None when no sequence has context (the attention output is then all zeros)."""
    max_len = int(context_lens.max()) if context_lens.numel() else 0
    if max_len == 0:
        return None
    num_blocks = triton.cdiv(max_len, block_size)
    # Gather only up to the longest context; padding ids are replaced by block 0, never trusted.
    blocks_used = (context_lens.long() + block_size - 1) // block_size  # [B]
    padding = torch.arange(num_blocks, device=block_tables.device)[None, :] >= blocks_used[:, None]  # [B, nb]
    table = block_tables[:, :num_blocks].long().masked_fill(padding, 0)  # table: [B, nb]
    positions = torch.arange(num_blocks * block_size, device=block_tables.device)  # [L]
    live = positions[None, :] < context_lens[:, None]  # live: [B, L]
    return DecodeGather(table, live, (~live).flatten().nonzero().squeeze(1))


def _gather_context(cache: torch.Tensor, table: torch.Tensor, dead_rows: torch.Tensor) -> torch.Tensor:
    """Each sequence's cache rows, in order: [B, nb * block_size, Hk, D]; dead rows zeroed."""
    batch, num_blocks = table.shape
    rows = cache.index_select(0, table.flatten())  # rows: [B * nb, block_size, Hk, D]
    # Dead rows are masked out of the softmax, but 0 * NaN is NaN: keep stale garbage out.
    rows.view(-1, rows.shape[2] * rows.shape[3]).index_fill_(0, dead_rows, 0)
    return rows.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])


def paged_attention_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gather: DecodeGather | None = None,
) -> torch.Tensor:
    """`gather`: decode_gather(block_tables, context_lens, block_size), if already known."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if gather is None:
        gather = decode_gather(block_tables, context_lens, k_cache.shape[1])
    if gather is None:
        return torch.zeros_like(q)
    live = gather.live
    k = _gather_context(k_cache, gather.table, gather.dead_rows).to(q.dtype)  # k: [B, L, Hk, D]
    v = _gather_context(v_cache, gather.table, gather.dead_rows).to(q.dtype)  # v: [B, L, Hk, D]
    # CPU SDPA (its flash kernel) keeps scores, max, exp and sum in fp32 for bf16/fp16 and, like
    # HF, rounds the probabilities to q.dtype for P @ V (fp32 accumulate). Measured faster than
    # upcasting to fp32 first (~2x at B=16, ctx ~300, Hq=12, Hk=4, D=64, bf16) and than an fp32
    # matmul + softmax (~3.5x); enable_gqa beats repeat_interleave. No live position -> zeros.
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        k.transpose(1, 2),  # [B, Hk, L, D]
        v.transpose(1, 2),  # [B, Hk, L, D]
        attn_mask=live[:, None, None, :],  # [B, 1, 1, L]
        scale=scale,
        enable_gqa=num_q_heads != num_kv_heads,
    )
    return out.squeeze(2)  # [B, Hq, D]


@triton.jit
def _paged_attention_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, scale_log2e,
    stride_q_seq, stride_q_head, stride_out_seq, stride_out_head,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    stride_table_seq,
    QUERIES_PER_KV: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    # One program per (sequence, kv head): all query heads of the group share each K/V load.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    group = tl.arange(0, GROUP_PAD)
    is_head = group < QUERIES_PER_KV
    q_heads = kv_head * QUERIES_PER_KV + group  # [G]
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)

    q_off = seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=is_head[:, None], other=0.0).to(tl.float32)  # q: [G, D]
    q = q * scale_log2e  # scores come out in log2 units, for exp2
    context_len = tl.load(context_lens_ptr + seq)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # [G]
    denom = tl.zeros([GROUP_PAD], tl.float32)  # [G]
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)  # acc: [G, D]
    for i in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + seq * stride_table_seq + i).to(tl.int64)
        live = i * BLOCK_SIZE + slots < context_len  # live: [N]
        k_off = block_id * stride_k_block + slots[:, None] * stride_k_slot + kv_head * stride_k_head + dims[None, :]
        v_off = block_id * stride_v_block + slots[:, None] * stride_v_slot + kv_head * stride_v_head + dims[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=live[:, None], other=0.0).to(tl.float32)  # k: [N, D]
        v = tl.load(v_cache_ptr + v_off, mask=live[:, None], other=0.0).to(tl.float32)  # v: [N, D]

        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # scores: [G, N]
        scores = tl.where(live[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # [G]; finite: block i has a live slot
        rescale = tl.exp2(running_max - new_max)  # [G]
        p = tl.exp2(scores - new_max[:, None])  # p: [G, N]
        denom = denom * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G, D]
        running_max = new_max

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # context_len 0 -> zeros
    out_off = seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=is_head[:, None])


def paged_attention_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape
    assert num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hk={num_kv_heads}"
    assert head_dim & (head_dim - 1) == 0 and block_size & (block_size - 1) == 0, "D and block_size: powers of 2"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # out: [B, Hq, D]
    queries_per_kv = num_q_heads // num_kv_heads
    if batch:
        _paged_attention_decode_kernel[(batch, num_kv_heads)](
            out, q, k_cache, v_cache, block_tables, context_lens, scale * 1.4426950408889634,  # log2(e)
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            QUERIES_PER_KV=queries_per_kv, GROUP_PAD=triton.next_power_of_2(queries_per_kv),
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        )
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gather: DecodeGather | None = None,
) -> torch.Tensor:
    if q.is_cuda:
        return paged_attention_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    if cpu.usable(q, k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous():
        return cpu.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_attention_decode_reference(q, k_cache, v_cache, block_tables, context_lens, scale, gather)
