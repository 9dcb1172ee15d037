"""GGUF's quantized linear weights (Q4_0, Q4_1, Q8_0) as the C kernels read them.

A GGUF file stores a quantized [O, K] weight row by row, each row as blocks of 32 k: a
scale (fp16), for Q4_1 a min (fp16), and the codes (4 bits, two k to a byte, or int8).
`pack` rearranges those bytes into the C kernels' records of 16 outputs x 32 k
(kernels/csrc/quantized.c has the layout): the same bytes, so the weight in memory is the
size it is in the file, and the same layout on every ISA. `dequantize` is the numerical
spec: the packed weight as float32, as gguf's own reference dequantizes the file's blocks
(tests/unit/test_quantized_linear.py checks both against it). `linear` multiplies by the C
kernel where the kernels run, and otherwise by the dequantized weight (made per call: a
fallback, not a fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu

# ggml's type numbers, which the C kernels use as the weight dtype code too.
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
GROUP = 32  # k per GGUF block and per record
RECORD_OUTPUTS = 16  # outputs per record
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_HEADER_BYTES = {"Q4_0": 32, "Q4_1": 64, "Q8_0": 32}  # the record's scales (and mins)


def record_bytes(fmt: str) -> int:
    return _HEADER_BYTES[fmt] + RECORD_OUTPUTS * (GROUP if fmt == "Q8_0" else GROUP // 2)


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear's weight [out_features, in_features] in `fmt`, packed: uint8 data
    [ceil(out / 16), in / 32, record_bytes(fmt)] (outputs past out_features are zeros)."""

    fmt: str
    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def code(self) -> int:
        return FORMATS[self.fmt]

    def fits_library(self) -> bool:
        return True  # one layout on every ISA

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def gguf_row_bytes(fmt: str, in_features: int) -> int:
    return in_features // GROUP * _GGUF_BLOCK_BYTES[fmt]


def pack(rows: torch.Tensor, fmt: str, in_features: int, out_features: int | None = None) -> QuantizedWeight:
    """rows: a GGUF tensor's stored bytes, uint8 [O, in_features / 32 * block bytes];
    out_features: more than O pads the weight with zero outputs (a last vocab shard)."""
    if fmt not in FORMATS:
        raise ValueError(f"quantized format {fmt!r} has no kernel; supported: {', '.join(FORMATS)}")
    if in_features % GROUP or rows.shape[1] != gguf_row_bytes(fmt, in_features):
        raise ValueError(f"{fmt} rows of {rows.shape[1]} bytes do not hold {in_features} values")
    stored, groups = rows.shape[0], in_features // GROUP
    out_features = max(out_features or stored, stored)
    padded = -(-out_features // RECORD_OUTPUTS) * RECORD_OUTPUTS
    blocks = torch.zeros(padded, groups, _GGUF_BLOCK_BYTES[fmt], dtype=torch.uint8)  # zero scales: zero weights
    blocks[:stored] = rows.reshape(stored, groups, -1)
    header = _HEADER_BYTES[fmt]
    # [O/16, 16 o, G, bytes] -> [O/16, G, bytes, 16 o]: each byte position's 16 outputs together
    by_output = blocks.reshape(padded // RECORD_OUTPUTS, RECORD_OUTPUTS, groups, -1).permute(0, 2, 3, 1)
    fields = by_output.reshape(padded // RECORD_OUTPUTS, groups, -1, RECORD_OUTPUTS)  # [.., byte, o]
    # fp16 fields are byte pairs: [.., 2 bytes, 16 o] -> [.., 16 o, 2 bytes]
    halves = [fields[:, :, i:i + 2].transpose(2, 3).reshape(*fields.shape[:2], 2 * RECORD_OUTPUTS)
              for i in range(0, header // RECORD_OUTPUTS, 2)]
    codes = fields[:, :, header // RECORD_OUTPUTS:].reshape(*fields.shape[:2], -1)  # [.., byte i, o]
    data = torch.cat([*halves, codes], dim=2).contiguous()
    return QuantizedWeight(fmt, data, out_features, in_features)


def concat(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
    """The weights stacked along their outputs, where their records join whole: every part
    quantized, in one format, of one in_features, and each but the last in whole records."""
    if any(p is None for p in parts) or len({(p.fmt, p.in_features) for p in parts}) != 1:
        return None
    if any(p.out_features % RECORD_OUTPUTS for p in parts[:-1]):
        return None
    data = torch.cat([p.data for p in parts], dim=0)
    return QuantizedWeight(parts[0].fmt, data, sum(p.out_features for p in parts), parts[0].in_features)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """float32 [out_features, in_features]: scale * (q - 8), scale * q + min, scale * q,
    each product and sum rounded as gguf's reference rounds them."""
    return _dequantize_records(weight.fmt, weight.data).reshape(-1, weight.in_features)[:weight.out_features]


def dequantize_rows(weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 [len(rows), in_features]: the given rows of the weight (an embedding's lookup)."""
    records = _dequantize_records(weight.fmt, weight.data[rows // RECORD_OUTPUTS])  # [T, 16, K]
    return records[torch.arange(len(rows)), rows % RECORD_OUTPUTS]


def _dequantize_records(fmt: str, data: torch.Tensor) -> torch.Tensor:
    """Records [N, G, bytes] -> float32 [N, 16 outputs, G * 32]."""
    n, groups, _ = data.shape
    scale = data[:, :, :32].contiguous().view(torch.float16).float()[:, :, None]  # [N, G, 1, 16 o]
    codes = data[:, :, _HEADER_BYTES[fmt]:]
    if fmt == "Q8_0":
        w = scale * codes.reshape(n, groups, GROUP, RECORD_OUTPUTS).view(torch.int8).float()  # [.., k, o]
    else:
        nibbles = codes.reshape(n, groups, GROUP // 2, RECORD_OUTPUTS)
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).float()  # [.., k, o]: low nibbles are k < 16
        if fmt == "Q4_0":
            w = scale * (q - 8)
        else:
            w = scale * q + data[:, :, 32:64].contiguous().view(torch.float16).float()[:, :, None]
    return w.permute(0, 3, 1, 2).reshape(n, RECORD_OUTPUTS, groups * GROUP)  # [.., o, (g, k)]


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, **fused) -> torch.Tensor:
    """x [B, K] (float32 or bfloat16) @ the dequantized weight.T + bias; `fused` as
    cpu.linear takes them, in the C kernel alone (the fallback runs the plain linear)."""
    if cpu.usable(x):
        return cpu.linear(x, weight, bias, **fused)
    if fused:
        raise ValueError("fused prologues and epilogues need the C kernels")
    return F.linear(x, dequantize(weight).to(x.dtype), bias)
