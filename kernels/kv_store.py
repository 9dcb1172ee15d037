"""Write the new tokens' K/V into the paged cache.

Invariants: key/value are [T, Hk, D]; k_cache/v_cache are [num_blocks, block_size, Hk, D]
and are written in place; slot_mapping is [T] int64 with slot = block_id * block_size +
offset_in_block, and slot < 0 means "skip this token" (its cache row is left untouched).
Slots of the tokens written are distinct.
"""

import torch
import triton
import triton.language as tl

from kernels import cpu


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = (slot_mapping >= 0).nonzero().squeeze(1)  # keep: [T'] token indices
    slots = slot_mapping.index_select(0, keep)  # slots: [T']
    k_rows = k_cache.view(-1, *k_cache.shape[2:])  # k_rows: [num_blocks * block_size, Hk, D]
    v_rows = v_cache.view(-1, *v_cache.shape[2:])
    k_rows.index_copy_(0, slots, key.index_select(0, keep).to(k_cache.dtype))
    v_rows.index_copy_(0, slots, value.index_select(0, keep).to(v_cache.dtype))


@triton.jit
def _store_kv_kernel(
    cache_ptr, src_ptr, slot_mapping_ptr,
    stride_src_tok, stride_src_head, stride_cache_block, stride_cache_slot, stride_cache_head, num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: leave the cache alone
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)  # mask: [Hk, D]
    src = tl.load(src_ptr + token * stride_src_tok + heads[:, None] * stride_src_head + dims[None, :], mask=mask)
    dst = cache_ptr + block_id * stride_cache_block + offset * stride_cache_slot + heads[:, None] * stride_cache_head
    tl.store(dst + dims[None, :], src.to(cache_ptr.dtype.element_ty), mask=mask)


def _store_one_triton(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = src.shape  # src: [T, Hk, D]
    assert cache.shape[2:] == (num_kv_heads, head_dim), f"cache {tuple(cache.shape)} vs tokens {tuple(src.shape)}"
    assert cache.stride(-1) == 1, "cache rows must be contiguous in head_dim"
    if src.stride(-1) != 1:
        src = src.contiguous()
    if num_tokens:
        _store_kv_kernel[(num_tokens,)](
            cache, src, slot_mapping,
            src.stride(0), src.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), num_kv_heads,
            BLOCK_SIZE=cache.shape[1], HEAD_DIM=head_dim,
            BLOCK_HEADS=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        )


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    slot_mapping = slot_mapping.contiguous()
    _store_one_triton(key, k_cache, slot_mapping)
    _store_one_triton(value, v_cache, slot_mapping)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if key.is_cuda:
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif cpu.usable(key, value, k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous():
        cpu.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
