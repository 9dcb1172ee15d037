"""Rotary position embedding (NeoX / Hugging Face "rotate_half" layout), applied to q and k.

Invariants: q is [T, Hq, D], k is [T, Hk, D], positions is [T] int64 and cos_sin_cache is
fp32 [max_pos, D] with cos(pos * f_i) in column i and sin(pos * f_i) in column D/2 + i.
The cache is only consumed here (rope scaling is the model's business). Dimension i pairs
with i + D/2:  out[i] = x[i]*cos_i - x[i+D/2]*sin_i,  out[i+D/2] = x[i+D/2]*cos_i + x[i]*sin_i.
cos/sin are rounded to q.dtype first, as HF. Returns new tensors; the inputs are untouched.
"""

import torch
import triton
import triton.language as tl

from kernels import cpu


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_half, sin_half = cos_sin_cache[positions].chunk(2, dim=-1)  # cos_half, sin_half: [T, D/2]
    cos = torch.cat((cos_half, cos_half), dim=-1).unsqueeze(1).to(q.dtype)  # cos: [T, 1, D]
    sin = torch.cat((sin_half, sin_half), dim=-1).unsqueeze(1).to(q.dtype)  # sin: [T, 1, D]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@triton.jit
def _rotary_kernel(
    out_ptr, x_ptr, positions_ptr, cos_sin_ptr,
    stride_x_tok, stride_x_head, stride_out_tok, stride_out_head, stride_cache_pos, num_heads,
    HALF_DIM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    heads = tl.arange(0, BLOCK_HEADS)
    in_half = half < HALF_DIM
    mask = (heads[:, None] < num_heads) & in_half[None, :]  # mask: [HEADS, D/2]
    cache_row = cos_sin_ptr + pos * stride_cache_pos
    cos = tl.load(cache_row + half, mask=in_half, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)  # [D/2]
    sin = tl.load(cache_row + HALF_DIM + half, mask=in_half, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)

    x_first = x_ptr + token * stride_x_tok + heads[:, None] * stride_x_head + half[None, :]  # [HEADS, D/2]
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)  # x1: [HEADS, D/2], dims [0, D/2)
    x2 = tl.load(x_first + HALF_DIM, mask=mask, other=0.0).to(tl.float32)  # x2: dims [D/2, D)
    out_first = out_ptr + token * stride_out_tok + heads[:, None] * stride_out_head + half[None, :]
    tl.store(out_first, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_first + HALF_DIM, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _rotate_triton(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape  # x: [T, H, D]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            out, x, positions, cos_sin_cache,
            x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin_cache.stride(0), num_heads,
            HALF_DIM=head_dim // 2, BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            BLOCK_HEADS=triton.next_power_of_2(num_heads),
        )
    return out


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = q.shape[-1]
    assert head_dim % 2 == 0 and k.shape[-1] == head_dim and cos_sin_cache.shape[-1] == head_dim
    positions = positions.contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    return _rotate_triton(q, positions, cos_sin_cache), _rotate_triton(k, positions, cos_sin_cache)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.is_cuda:
        return rotary_triton(q, k, positions, cos_sin_cache)
    if cpu.usable(q, k, cos_sin_cache):
        return cpu.rotary(q, k, positions, cos_sin_cache)
    return rotary_reference(q, k, positions, cos_sin_cache)
