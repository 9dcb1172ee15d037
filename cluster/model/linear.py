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

Below both, for the rows of a decode step: the C kernel (kernels/cpu.py) on its own
packed copy of the weight (blocks of output columns, each weight vector loaded once and
used for every row from a register). A step's linears on the same EPYC (2 threads,
SmolLM2-135M's 30 layers, weights cold as in a real step), C kernel vs oneDNN, ms, each
pair measured side by side (alternating) in one run:

    rows                          1        4        8        16       32       64
    bf16 (AVX512-BF16), packed    7 / 12   7 / 10   8 / 12   13 / 16  25 / 23  45 / 44
    fp32, packed                 10 / 20  12 / 15  15 / 19   25 / 27  49 / 57
    fp32 capped at AVX2, packed  14 / 22  19 / 31  24 / 28   41 / 47  65 / 55
    bf16 capped at AVX2, F.linear                  22 / 54   38 / 100 75 / 211  (512: 1136 / 3551)

The same on an Intel Xeon with AMX (Sapphire Rapids class, 2 threads), where the C kernel
multiplies bf16 in AMX tiles of 16 rows (the same packed weight):

    rows                          1        4        8        16       32       64
    bf16, AMX                    10 / 13  10 / 13  10 / 13   10 / 13  13 / 15  18 / 16
    bf16, AMX forced off          10 / 14  14 / 18  19 / 20   26 / 27  43 / 43  77 / 74
    fp32, packed                 16 / 21  21 / 22  25 / 25   37 / 30  60 / 41  107 / 65
    fp32 capped at AVX2, packed  18 / 25  21 / 31  25 / 37   34 / 44  52 / 58  89 / 89

so the C kernel takes up to C_KERNEL_MAX_ROWS rows, oneDNN the rest. In native bf16 (AVX512-BF16
or AMX) it takes up to WIDE_KERNEL_MAX_ROWS = 64: there oneDNN's GEMM is at best a little faster
per linear from 33 rows, and a step of up to 64 rows then runs in one C call, which saves more.
With AMX, a step of 16 decodes beside a 32-token prompt chunk: 39-42 ms in one call, 50-52 ms op
by op. On the AMD EPYC with AVX-512-BF16 (2 threads, a step's linears, inputs reused, C vs
oneDNN): 32 rows 21.2 vs 23.9 ms, 64 rows 37.5 vs 39.3 ms; and 16 decodes with 256-token
prompts joining under the step budget (steps of ~52 rows) ran 42.7 ms a mixed step in one call
against 58.1 ms op by op (offline, 64 requests 256 -> 64 at 16 running: 189 vs 144 tok/s).
fp32 stays at C_KERNEL_MAX_ROWS: on the Intel Xeon oneDNN's fp32 GEMM wins from 32 rows.
bf16 without native bf16 takes the C kernel at any row count (oneDNN cannot pack bf16 there,
and F.linear emulates it 3x slower). A step whose rows the C
kernel takes also runs all its layers in one C call (cluster/model/cpu_step.py), which
saves more than oneDNN's lead at a few row counts (fp32 at 16 rows) costs. Each packed copy
costs one more copy of the weight in memory (half of one for an fp32 model's compact copy,
`pack_linears_for_cpu` below).
bf16 packing in oneDNN needs native bf16 (AVX-512-BF16 or AMX, cluster/host/cpu_features.py):
without it oneDNN refuses to pack (AVX2) or only emulates bf16, and F.linear is the path.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

from cluster.host.cpu_features import detect
from cluster.model.quantized_holder import HoldsQuantizedWeight
from kernels import cpu, quantized

PACKED_MAX_ROWS = 256
C_KERNEL_MAX_ROWS = 16
WIDE_KERNEL_MAX_ROWS = 64


def c_kernel_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which the C kernel beats the other paths on this CPU (the tables above)."""
    if dtype == torch.bfloat16:
        return WIDE_KERNEL_MAX_ROWS if detect().native_bf16 else sys.maxsize
    return C_KERNEL_MAX_ROWS if dtype == torch.float32 else 0


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


class Linear(HoldsQuantizedWeight, nn.Linear):
    packed_weight: torch.Tensor | None = None  # oneDNN's
    kernel_weight: cpu.PackedWeight | None = None  # the C kernel's
    compact = False  # the C kernel's copy of an fp32 weight may be bf16 (cpu.pack_linear_weight)

    def dense_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def pack_for_cpu(self, compact: bool = False) -> None:
        """compact: the weight is fp32 and every value is a bf16 one (cpu.bf16_holds)."""
        if self.quantized_weight is not None:
            return  # read as it is: the C kernels' records are its only copy
        self.compact = compact
        if cpu.usable(self.weight):
            self.kernel_weight = cpu.pack_linear_weight(self.weight.detach(), compact=compact)
        if can_pack(self.weight):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACKED_MAX_ROWS)

    def takes_c_kernel(self, x: torch.Tensor) -> bool:
        if self.quantized_weight is not None:  # at any row count: there is no dense weight for another path
            return cpu.usable(x)
        return (self.kernel_weight is not None and x.shape[0] <= c_kernel_max_rows(x.dtype)
                and x.dtype == self.weight.dtype and cpu.usable(x))

    def c_kernel_weight(self) -> cpu.PackedWeight | quantized.QuantizedWeight:
        """The C kernel's weight, packed again if the kernels were rebuilt for another ISA."""
        if self.quantized_weight is not None:
            return self.quantized_weight
        if not self.kernel_weight.fits_library():
            self.kernel_weight = cpu.pack_linear_weight(self.weight.detach(), compact=self.compact)
        return self.kernel_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.quantized_weight is not None:
            return quantized.linear(x, self.quantized_weight, self.bias)
        if self.takes_c_kernel(x):
            return cpu.linear(x, self.c_kernel_weight(), self.bias)
        if self.packed_weight is not None and x.shape[0] <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears_for_cpu(linears: list[Linear]) -> None:
    """Pre-pack a model's linears. An fp32 model whose every linear weight bf16 holds exactly
    (a bf16 checkpoint served in fp32) packs the C kernel's copies compact; all or none, as a
    step's layers take one weight dtype (cluster/model/cpu_step.py)."""
    dense = [m for m in linears if m.quantized_weight is None]
    compact = bool(dense) and all(cpu.usable(m.weight) and cpu.bf16_holds(m.weight) for m in dense)
    for m in linears:
        m.pack_for_cpu(compact)


def fuse_linears(*parts: Linear) -> Linear:
    """One Linear whose output is the concatenation of `parts`' outputs. Quantized parts
    stay quantized where their records join whole (one format, outputs in whole records);
    otherwise they are dequantized into the dense fused weight."""
    joined = quantized.concat([p.quantized_weight for p in parts])
    dtype = parts[0].weight.dtype
    if joined is None:
        weight = torch.cat([p.dense_weight().data.to(dtype) for p in parts], dim=0)
        out_features, in_features = weight.shape
    else:
        weight, out_features, in_features = torch.empty(0, dtype=dtype), joined.out_features, joined.in_features
    fused = Linear(in_features, out_features, bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.quantized_weight = joined
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.data for p in parts]), requires_grad=False)
    return fused
