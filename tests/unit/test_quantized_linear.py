"""Quantized weights (kernels/quantized.py, kernels/csrc/quantized.c): GGUF's Q4_0, Q4_1 and
Q8_0 blocks packed into the kernels' records, against gguf's own reference dequantization,
and the C linear on them against the dequantized weight's matmul, on every ISA build
tests/unit/test_cpu_kernels.py runs (native, AVX2, SSE, ...).

Exactness: the packed weight dequantizes to gguf's values bit for bit; the C linear differs
from `x @ dequantize(w).T` only in summation order (and Q4_1's `scale q + min`, one fused
rounding where gguf's reference rounds twice)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cluster.model.linear import Linear, fuse_linears
from kernels import cpu, quantized
from tests.unit.test_cpu_kernels import ISA_BUILDS

FORMATS = list(quantized.FORMATS)


@pytest.fixture(params=list(ISA_BUILDS))
def isa(request):
    cpu.configure(ISA_BUILDS[request.param])
    assert cpu.available(), "the C kernels did not build"
    yield request.param
    cpu.configure(ISA_BUILDS["native"])


def _gguf_rows(fmt: str, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(a weight's GGUF rows in fmt, gguf's dequantization of them as float32 [O, K])."""
    w = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32) / in_features**0.5
    qtype = GGMLQuantizationType[fmt]
    rows = gguf_quantize(w, qtype)
    reference = np.ascontiguousarray(gguf_dequantize(rows, qtype), dtype=np.float32).reshape(out_features, in_features)
    return torch.from_numpy(rows), torch.from_numpy(reference)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_features", [16, 40, 7])  # whole records; part of one (padded with zero outputs)
def test_packed_weights_dequantize_to_ggufs_values_and_keep_its_bytes(fmt, out_features):
    rows, reference = _gguf_rows(fmt, out_features, 96)
    weight = quantized.pack(rows, fmt, 96)
    assert torch.equal(quantized.dequantize(weight), reference)
    padded = -(-out_features // 16) * 16
    assert weight.nbytes == rows.numel() * padded // out_features  # the file's bytes (and zero outputs to a whole record)
    ids = torch.tensor([0, out_features - 1, 3, 3])
    assert torch.equal(quantized.dequantize_rows(weight, ids), reference[ids])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 1 and 8: a decode step; 9 and 33: past one register block of rows; 0: a step that samples nothing
@pytest.mark.parametrize("rows", [0, 1, 9, 33])
@pytest.mark.parametrize("in_features, out_features", [(64, 48), (96, 40), (32, 7)])
def test_the_c_linear_multiplies_by_the_dequantized_weight(isa, fmt, dtype, rows, in_features, out_features):
    packed_rows, reference = _gguf_rows(fmt, out_features, in_features)
    weight = quantized.pack(packed_rows, fmt, in_features)
    x, bias = torch.randn(rows, in_features).to(dtype), torch.randn(out_features).to(dtype)
    out = quantized.linear(x, weight, bias)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    exact = F.linear(x.double(), reference.double(), bias.double())
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out.double(), exact, **tolerance)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_fused_prologues_and_epilogues_read_quantized_weights_as_dense_ones(isa, fmt):
    """RMSNorm before, SiLU-and-mul before, the residual after: as around an fp32 weight."""
    rows, reference = _gguf_rows(fmt, 48, 64)
    weight, dense = quantized.pack(rows, fmt, 64), cpu.pack_linear_weight(reference)
    x, residual = torch.randn(5, 64), torch.randn(5, 48)
    norm = (torch.rand(64) + 0.5, 1e-6)
    for kwargs in ({"norm": norm}, {"residual": residual}):
        torch.testing.assert_close(cpu.linear(x, weight, None, **kwargs), cpu.linear(x, dense, None, **kwargs),
                                   rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(5, 128)
    torch.testing.assert_close(cpu.linear(gate_up, weight, None, silu_mul=True),
                               cpu.linear(gate_up, dense, None, silu_mul=True), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rows_beside_it(isa):
    rows, _ = _gguf_rows("Q4_1", 80, 64)
    weight = quantized.pack(rows, "Q4_1", 64)
    x = torch.randn(16, 64)
    together = quantized.linear(x, weight, None)
    for n in range(1, 16):
        assert torch.equal(quantized.linear(x[:n], weight, None), together[:n]), n


def test_without_the_kernels_the_dequantized_weight_is_multiplied(monkeypatch):
    rows, reference = _gguf_rows("Q8_0", 24, 64)
    weight = quantized.pack(rows, "Q8_0", 64)
    monkeypatch.setenv(cpu.SWITCH_ENV, "0")
    cpu.reload()
    try:
        x = torch.randn(3, 64)
        torch.testing.assert_close(quantized.linear(x, weight, None), x @ reference.T)
    finally:
        monkeypatch.delenv(cpu.SWITCH_ENV)
        cpu.reload()


def test_weights_join_whole_records_and_only_those():
    q, _ = _gguf_rows("Q4_1", 32, 64)
    k, _ = _gguf_rows("Q4_1", 16, 64, seed=1)
    joined = quantized.concat([quantized.pack(q, "Q4_1", 64), quantized.pack(k, "Q4_1", 64)])
    assert joined.out_features == 48
    assert torch.equal(quantized.dequantize(joined),
                       torch.cat([quantized.dequantize(quantized.pack(q, "Q4_1", 64)),
                                  quantized.dequantize(quantized.pack(k, "Q4_1", 64))]))
    odd, _ = _gguf_rows("Q4_1", 8, 64)
    other, _ = _gguf_rows("Q8_0", 16, 64)
    assert quantized.concat([quantized.pack(odd, "Q4_1", 64), quantized.pack(k, "Q4_1", 64)]) is None  # 8 outputs: part of a record
    assert quantized.concat([quantized.pack(q, "Q4_1", 64), quantized.pack(other, "Q8_0", 64)]) is None  # two formats
    assert quantized.concat([quantized.pack(q, "Q4_1", 64), None]) is None


def test_bad_rows_are_refused_by_name():
    rows, _ = _gguf_rows("Q4_0", 16, 64)
    with pytest.raises(ValueError, match="Q4_K"):
        quantized.pack(rows, "Q4_K", 64)
    with pytest.raises(ValueError, match="do not hold 96 values"):
        quantized.pack(rows, "Q4_0", 96)


def _linear(fmt: str, out_features: int, in_features: int, seed: int) -> tuple[Linear, torch.Tensor]:
    rows, reference = _gguf_rows(fmt, out_features, in_features, seed)
    linear = Linear(in_features, out_features, bias=False)
    linear.load_quantized(quantized.pack(rows, fmt, in_features))
    assert linear.weight.numel() == 0  # no dense copy
    return linear, reference


def test_fused_projections_stay_quantized_or_become_dense_but_compute_the_same():
    x = torch.randn(3, 64)
    for formats, stays in ((("Q4_1", "Q4_1", "Q4_1"), True), (("Q4_1", "Q8_0", "Q8_0"), False)):
        parts = [_linear(fmt, out, 64, seed) for seed, (fmt, out) in enumerate(zip(formats, (32, 16, 16)))]
        fused = fuse_linears(*(linear for linear, _ in parts))
        assert (fused.quantized_weight is not None) == stays
        expected = x @ torch.cat([reference for _, reference in parts]).T
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_python_packs_the_records_the_c_kernel_reads(isa, fmt):
    """One layout, two homes (kernels/quantized.py packs, quantized.c reads): their record sizes agree."""
    rows, _ = _gguf_rows(fmt, 16, 64)
    weight = quantized.pack(rows, fmt, 64)
    assert weight.data.shape[2] == quantized.record_bytes(fmt) == cpu.library().pd_quantized_record_bytes(quantized.FORMATS[fmt])
