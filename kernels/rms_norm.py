"""RMSNorm: y = weight * (x / sqrt(mean(x^2, -1) + eps)), normalised over the last dim.

Invariants: x is [..., H] (leading dims are flattened, so Qwen3's per-head norm on
[T, H, D] with weight [D] works); weight is [H]. The mean is taken in fp32, the normalised
value is rounded to x.dtype *before* the weight multiply, and the result has dtype
promote(weight, x), exactly as Hugging Face LlamaRMSNorm.
"""

import torch
import triton
import triton.language as tl

from kernels import cpu


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, weight_ptr, stride_x_row, stride_out_row, hidden, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=in_row, other=0.0).to(tl.float32)  # x: [H]
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to x.dtype, as HF
    w = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)  # w: [H]
    tl.store(out_ptr + row * stride_out_row + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=in_row)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} does not match hidden size {hidden}"
    rows = x.reshape(-1, hidden)  # rows: [N, H]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            out, rows, weight.contiguous(), rows.stride(0), out.stride(0), hidden, eps,
            BLOCK_H=triton.next_power_of_2(hidden),
        )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    if cpu.usable(x, weight):
        return cpu.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
