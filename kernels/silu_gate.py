"""SiLU-gated MLP activation: silu(gate) * up, with x = cat(gate, up) on the last dim.

Invariants: x is [T, 2*I]; output is [T, I] in x.dtype. silu(gate) is rounded to x.dtype
before the multiply, matching Hugging Face's `act_fn(gate_proj(x)) * up_proj(x)`.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import cpu


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # gate, up: [T, I]
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x_row, stride_out_row, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < inter
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=in_row, other=0.0).to(tl.float32)  # gate: [BLOCK]
    up = tl.load(x_ptr + row * stride_x_row + inter + cols, mask=in_row, other=0.0).to(tl.float32)  # up: [BLOCK]
    act = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to x.dtype, as HF
    tl.store(out_ptr + row * stride_out_row + cols, (act * up).to(out_ptr.dtype.element_ty), mask=in_row)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} is not 2 * intermediate"
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])  # rows: [N, 2*I]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)  # out: [N, I]
    block = min(1024, triton.next_power_of_2(inter))
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](out, rows, rows.stride(0), out.stride(0), inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return silu_and_mul_triton(x)
    if cpu.usable(x) and x.shape[-1] % 2 == 0:
        return cpu.silu_and_mul(x)
    return silu_and_mul_reference(x)
