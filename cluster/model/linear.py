"""Linear layer, and fusing several into one matmul.

On CPU the default GEMM path leaves speed on the table for the shapes of serving.
Measured on an AMD EPYC with AVX-512-BF16 (2 threads, SmolLM2-135M's shapes), weight
bytes streamed per second for 1 and 8 rows (decode steps of batch 1 and 8):

                                bf16 (1 row)    fp32 (1 row)    fp32 (8 rows)
    oneDNN, pre-packed weight   45-85 GB/s      37-121 GB/s     38-77 GB/s
    F.linear                    25-36 GB/s      13-71 GB/s      9-24 GB/s
    torch.mv                    11-27 GB/s      13-66 GB/s

(fp32 with oneDNN and ATen capped at AVX2, as on an AVX2-only EPYC: packed 22-118 GB/s,
F.linear 9-70.) So every row count up to PACKED_MAX_ROWS takes the packed path, and
F.linear is used beyond (prefill), where it is as fast. All paths accumulate in fp32.

Below both, for the few rows of a small decode step: the C kernel (kernels/cpu.py), which
streams each weight row once for all rows. A step's linears on the same EPYC (2 threads,
SmolLM2-135M's 30 layers, weights cold as in a real step), C kernel vs packed oneDNN, ms:

    rows                       1            2            4            8
    bf16 (AVX512-BF16)     7.5-11 / 15   9.2 / 16     10-11 / 13-16  ties
    fp32                   20 / 25.5     21 / 31      31 / 24
    fp32 capped at AVX2    16 / 30.5     18 / 35      28 / 42        39 / 46

and where oneDNN's fast paths are absent (same EPYC, capped at AVX2, 2 threads, ms):
    rows                       4            8            16
    fp32 (vs packed)       24 / 32      30-34 / 28-40  42 / 36
    bf16 (vs F.linear: no native bf16, so nothing to pack)
                           13 / 24      20 / 46      37 / 91
so the C kernel takes up to `c_kernel_max_rows(dtype)` rows, oneDNN the rest.
The packed copy costs one more copy of the weight in memory, so packing is opt-in
(`pack_for_cpu`). bf16 packing needs native bf16 (AVX-512-BF16 or AMX,
cluster/cpu_features.py): without it oneDNN refuses to pack (AVX2) or only emulates
bf16, and F.linear is the path.
"""

import torch
import torch.nn.functional as F
from torch import nn

from cluster.cpu_features import detect
from kernels import cpu

PACKED_MAX_ROWS = 256


def c_kernel_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which the C kernel beats the other paths on this CPU (the tables above)."""
    cpu_features = detect()
    if dtype == torch.bfloat16:
        return 4 if cpu_features.native_bf16 else 16
    if dtype == torch.float32:
        return 2 if cpu_features.avx512 else 4
    return 0


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return (
        weight.dtype == torch.bfloat16
        and detect().native_bf16
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()  # what torch's own build and ISA cap allow
    )


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        if can_pack(self.weight):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACKED_MAX_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if x.shape[0] <= c_kernel_max_rows(x.dtype) and x.dtype == self.weight.dtype and cpu.usable(x, self.weight):
            return cpu.linear(x, self.weight, self.bias)
        if self.packed_weight is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fuse_linears(*parts: nn.Linear) -> Linear:
    """One Linear whose output is the concatenation of `parts`' outputs."""
    weight = torch.cat([p.weight.data for p in parts], dim=0)
    has_bias = parts[0].bias is not None
    fused = Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.data for p in parts]), requires_grad=False)
    return fused
