"""The C kernels (kernels/csrc/) against their torch references, built twice:
for this CPU (`-march=native`) and capped at AVX2 (as on an AVX2-only EPYC), so both code
paths run on any machine. Also: the build cache, the fallback when nothing can be built.

Exactness: rotary, store_kv and bf16 RMSNorm round exactly as torch does, so they compare
equal; sums (linear, RMSNorm's mean, attention) differ from torch's only in summation order.
"""

import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from cluster.host.cpu_features import compiler_isa_flags, cpu_flags, detect, features_from_flags
from kernels import cpu
from kernels.kv_store import store_kv_reference
from kernels.rms_norm import rms_norm_reference
from kernels.rotary import rotary_reference
from kernels.silu_gate import silu_and_mul_reference
from tests.unit.test_kernels import _caches, _cos_sin_cache, _naive_decode_attention, _paged_setup, _tol

DTYPES = [torch.float32, torch.bfloat16]
AVX2_FLAGS = compiler_isa_flags(features_from_flags(cpu_flags(), frozenset({"avx512"})))  # as on an AVX2-only EPYC
SSE_FLAGS = compiler_isa_flags(features_from_flags(cpu_flags(), frozenset({"avx2"})))  # x86-64 without AVX
# The builds every test runs on: for this CPU (as this process may use it: PDSERVE_CPU_DISABLE
# caps it, so that a suite run with avx512 off tests what an AVX2-only CPU runs), capped at
# AVX2, without AVX (4-lane vectors), on an AMX CPU also without AMX (as on an AMD EPYC with
# AVX-512-BF16), and on an AVX-512-BF16 CPU also without bf16 products (as on an Intel Xeon
# before Cooper Lake: bf16 weights widened to fp32, 16 lanes), so each code path of the C files
# runs here.
ISA_BUILDS = {"native": compiler_isa_flags(detect()), "AVX2": AVX2_FLAGS, "SSE": SSE_FLAGS}
if features_from_flags(cpu_flags(), frozenset()).amx:
    ISA_BUILDS["no AMX"] = compiler_isa_flags(features_from_flags(cpu_flags(), frozenset({"amx"})))
if features_from_flags(cpu_flags(), frozenset()).avx512_bf16:
    ISA_BUILDS["no BF16"] = compiler_isa_flags(features_from_flags(cpu_flags(), frozenset({"avx512_bf16"})))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=list(ISA_BUILDS), autouse=True)
def isa(request):
    """Every test runs on each of ISA_BUILDS."""
    cpu.configure(ISA_BUILDS[request.param])
    assert cpu.available(), "the C kernels did not build"
    yield request.param
    cpu.configure(ISA_BUILDS["native"])


def _disassembly(path) -> str:
    return subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout


def test_the_build_follows_the_isa_cap(isa):
    path = cpu.build()
    assert path.exists() and path.parent == cpu.CACHE_DIR
    code = _disassembly(path)
    if isa == "AVX2":
        assert "zmm" not in code
        assert "-mno-avx512f" in cpu.compile_flags()
    elif isa == "SSE":
        assert "ymm" not in code and "zmm" not in code  # 4-lane code only (this build once failed: an AVX intrinsic)
        assert "-mno-avx" in cpu.compile_flags()
    elif " avx512f " in open("/proc/cpuinfo").read() and "-mno-avx512f" not in cpu.compile_flags():
        assert "zmm" in code  # an AVX-512 CPU gets AVX-512 code
    has_amx = detect().amx and isa == "native"
    assert ("tdpbf16ps" in code) == has_amx  # AMX tiles exactly where the CPU has them and they are not forced off
    assert cpu.amx_tiles() == has_amx
    has_bf16_products = detect().avx512_bf16 and isa not in ("AVX2", "SSE", "no BF16")
    assert ("vdpbf16ps" in code) == has_bf16_products == cpu.bf16_products()


@pytest.mark.parametrize("dtype", DTYPES)
# 0: a step that samples no row; 9, 20: more rows than one register block; 20, 33: than one AMX tile (16 rows)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 9, 20, 33])
# 7 and 40 outputs: part of a block; 33 and 100 inputs: not whole AMX tiles of k (pairs pad them)
@pytest.mark.parametrize("in_features, out_features", [(64, 96), (100, 7), (33, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(dtype, rows, in_features, out_features, bias):
    x = torch.randn(rows, in_features).to(dtype)
    w = (torch.randn(out_features, in_features) / in_features**0.5).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    out = cpu.linear(x, cpu.pack_linear_weight(w), b)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    exact = F.linear(x.double(), w.double(), b.double() if bias else None)
    torch.testing.assert_close(out.double(), exact, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
# outputs: one block of the widest ISA's; one block past whole passes of 3 (AVX2's fp32); several passes
@pytest.mark.parametrize("in_features, out_features", [(64, 8), (64, 128), (96, 136)])
def test_a_linear_row_does_not_depend_on_the_rows_beside_it(dtype, in_features, out_features):
    """Bit for bit, whatever the batch: a decode step padded to a bucket, or a request in a
    bigger batch, gets the same row (the AVX2 build's 1-row, 1-block variant once rounded
    its sums apart from the others' fused multiply-adds)."""
    x = torch.randn(16, in_features).to(dtype)
    packed = cpu.pack_linear_weight(torch.randn(out_features, in_features).to(dtype))
    together = cpu.linear(x, packed, None)
    for rows in range(1, 16):
        assert torch.equal(cpu.linear(x[:rows], packed, None), together[:rows]), rows


def test_bf16_holds_exactly_the_fp32_tensors_whose_values_bf16_has():
    w = torch.randn(48, 64).to(torch.bfloat16).float()
    assert cpu.bf16_holds(w)
    w[3, 5] += 2**-20  # one value bf16 rounds
    assert not cpu.bf16_holds(w)
    assert not cpu.bf16_holds(torch.randn(4, 4).to(torch.bfloat16))  # a bf16 tensor: not an fp32 one


@pytest.mark.parametrize("rows", [1, 3, 5, 9, 16])
# one block of the widest ISA's; a pass of 3 blocks of AVX2's fp32 and one more; an odd k (the
# widened pairs' last high halves are padding)
@pytest.mark.parametrize("in_features, out_features", [(64, 16), (96, 136), (33, 40)])
def test_a_compact_weight_computes_what_its_fp32_weight_does(isa, rows, in_features, out_features):
    """fp32 rows times an fp32 weight that bf16 holds: packed compact (bf16, where the build's
    bf16 packs as its fp32 does), every output is the fp32-packed weight's bit for bit, with
    each prologue and epilogue (tests/integration/test_loader.py: a whole model's steps)."""
    w = (torch.randn(out_features, in_features) / in_features**0.5).to(torch.bfloat16).float()
    compact, plain = cpu.pack_linear_weight(w, compact=True), cpu.pack_linear_weight(w)
    assert cpu.compact_weights() == (not cpu.bf16_products())  # bf16 products pack bf16 in pairs
    assert compact.data.dtype == (torch.bfloat16 if cpu.compact_weights() else torch.float32)
    assert plain.data.dtype == torch.float32
    if cpu.compact_weights():  # half the bytes, k padded to even (widened pairs)
        assert compact.data.nbytes * 2 * in_features == plain.data.nbytes * (in_features + in_features % 2)
    x, bias = torch.randn(rows, in_features), torch.randn(out_features)
    norm = (torch.rand(in_features) + 0.5, 1e-6)
    residual = torch.randn(rows, out_features)
    for kwargs in ({}, {"norm": norm}, {"residual": residual}):
        assert torch.equal(cpu.linear(x, compact, bias, **kwargs), cpu.linear(x, plain, bias, **kwargs)), kwargs
    gate_up = torch.randn(rows, 2 * in_features)
    assert torch.equal(cpu.linear(gate_up, compact, None, silu_mul=True), cpu.linear(gate_up, plain, None, silu_mul=True))


def test_linear_takes_a_strided_input():
    x = torch.randn(2, 128)[:, ::2]  # [2, 64], rows 128 apart, not contiguous
    w = torch.randn(32, 64)
    torch.testing.assert_close(cpu.linear(x, cpu.pack_linear_weight(w), None), F.linear(x, w))


def test_a_weight_packed_by_another_build_is_told_apart(isa):
    """Each build packs for its own ISA (AVX512-BF16 / AMX pairs, or its vector width), and
    `Linear` repacks when the library it runs on changed."""
    from cluster.model.linear import Linear  # noqa: PLC0415

    layer = Linear(64, 48, bias=False).to(torch.bfloat16)
    layer.pack_for_cpu()
    x = torch.randn(3, 64).to(torch.bfloat16)
    expected = F.linear(x.double(), layer.weight.double())
    other = [] if ISA_BUILDS[isa] == AVX2_FLAGS else AVX2_FLAGS
    cpu.configure(other)
    try:
        # The AVX2 build packs as the one before it only where that one is 8 lanes wide too:
        # the native build on a CPU without AVX-512 (SSE's packs 4 lanes wide).
        same_layout = isa != "SSE" and " avx512f " not in open("/proc/cpuinfo").read()
        assert layer.kernel_weight.fits_library() == same_layout
        torch.testing.assert_close(layer(x).double(), expected, **_tol(torch.bfloat16))
        assert layer.kernel_weight.fits_library()
    finally:
        cpu.configure(ISA_BUILDS[isa])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 576), (7, 100), (70, 64)])  # 70: rows split over threads
def test_rms_norm_matches_reference(dtype, tokens, hidden):
    x, w = torch.randn(tokens, hidden).to(dtype), torch.randn(hidden).to(dtype)
    out = cpu.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype
    want = rms_norm_reference(x, w, 1e-6)
    if dtype == torch.bfloat16:
        # The same rounding steps; a mean that differs in its last fp32 bit may still move a
        # value across a bf16 rounding boundary, so allow one ulp on a few elements.
        assert (out != want).float().mean() < 0.01
    torch.testing.assert_close(out, want, **_tol(dtype))


def test_rms_norm_per_head_on_a_strided_view():
    qkv = torch.randn(5, 3 * 4 * 32)
    q = qkv[:, : 4 * 32].view(5, 4, 32)  # Qwen3's per-head q norm: rows 384 apart
    w = torch.randn(32)
    torch.testing.assert_close(cpu.rms_norm(q, w, 1e-6), rms_norm_reference(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, inter", [(1, 1536), (7, 33), (70, 64)])  # 70: rows split over threads
def test_silu_and_mul_matches_reference(dtype, tokens, inter):
    x = (torch.randn(tokens, 2 * inter) * 6).to(dtype)
    x[0, :3] = torch.tensor([-100.0, 0.0, 100.0]).to(dtype)  # exp underflows, zero, saturates
    out = cpu.silu_and_mul(x)
    want = silu_and_mul_reference(x)
    assert out.shape == want.shape and out.dtype == dtype
    torch.testing.assert_close(out, want, **_tol(dtype))
    # SiLU's exp differs from torch's in the last fp32 bit, so bf16 results rarely differ at all
    assert dtype == torch.float32 or (out != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [6, 40])  # 40: tokens split over threads
def test_rotary_equals_reference_on_qkv_views(dtype, head_dim, tokens):
    hq, hk = 4, 2
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim).to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    before = qkv.clone()
    positions, cache = torch.randint(0, 32, (tokens,)), _cos_sin_cache(32, head_dim)
    for got, want in zip(cpu.rotary(q, k, positions, cache), rotary_reference(q, k, positions, cache)):
        assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(qkv, before)  # inputs untouched, as the reference


@pytest.mark.parametrize("src_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.bfloat16)])
def test_store_kv_equals_reference(src_dtype, cache_dtype):
    kv = torch.randn(5, 2 * 2 * 64).to(src_dtype)
    k, v = kv[:, :128].view(5, 2, 64), kv[:, 128:].view(5, 2, 64)  # strided, as split from qkv
    slots = torch.tensor([3, -1, 17, 30, 8])
    want_k, want_v = _caches(4, 8, 2, 64, cache_dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    store_kv_reference(k, v, want_k, want_v, slots)
    cpu.store_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", DTYPES)
# Query heads per KV head 1 to 16 (the kernel takes them 4 at a time, and up to 16 in one AMX
# tile); blocks of one 16-row group, of several (64), and smaller (8); dims a multiple of a
# tile (64, 128), three 32-dim chunks (96: the bf16 value pass walks two, then one) or not a
# multiple of 32 (80: vector and scalar tails on every ISA).
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 2), (9, 3), (4, 1), (12, 2), (16, 1)])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (128, 8), (96, 16), (64, 64), (80, 32)])
def test_paged_attention_matches_naive(dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    # NaN everywhere but the live rows, and NaN blocks as table padding: any stray read shows.
    args = _paged_setup([1, 17, 40, 0], num_q_heads, num_kv_heads, head_dim, block_size, dtype, "nan_blocks")
    out = cpu.paged_attention_decode(*args, head_dim**-0.5)
    assert out.shape == args[0].shape and out.dtype == dtype and not out.isnan().any()
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # context 0
    want = _naive_decode_attention(*(a[:3] if i in (0, 3, 4) else a for i, a in enumerate(args)), head_dim**-0.5)
    torch.testing.assert_close(out[:3].double(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 2, 16), (4, 4, 80)])
def test_a_decode_row_attends_alike_alone_and_in_a_batch(dtype, num_q_heads, num_kv_heads, head_dim, two_torch_threads):
    """Bit for bit: with fewer rows than threads each KV head is a work item of its own, with
    more a row is one item; the same sums either way."""
    q, k_cache, v_cache, tables, lens = _paged_setup([7, 33, 18, 50, 1], num_q_heads, num_kv_heads, head_dim, 16, dtype,
                                                     "nan_blocks")
    together = cpu.paged_attention_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
    for b in range(len(lens)):
        alone = cpu.paged_attention_decode(q[b : b + 1], k_cache, v_cache, tables[b : b + 1], lens[b : b + 1], head_dim**-0.5)
        assert torch.equal(alone, together[b : b + 1]), b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 48])  # 48: parts rounded up to whole blocks
@pytest.mark.parametrize("q_scale", [1.0, 200.0])  # 200: a part's weights can underflow beside another's
def test_a_long_decode_context_is_attended_in_parts(dtype, block_size, q_scale, two_torch_threads):
    """A decode row's context past 1024 positions is split into equal parts, work items of
    their own whose outputs combine by their log-sum-exp: the same attention at 1024 (one
    part), 1025 and 1100 (two) and 2100 (three) positions and at 30; bit for bit alone and
    in a batch (alone, a row of one part is split by KV head instead)."""
    q, k_cache, v_cache, tables, lens = _paged_setup([1100, 1025, 1024, 2100, 30], 9, 3, 64, block_size, dtype,
                                                     "nan_blocks")
    q = (q.float() * q_scale).to(dtype)
    together = cpu.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert not together.isnan().any()
    want = _naive_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    # Scores of ~600 at q_scale 200: fp32 holds them to ~4e-5, and every weight moves with them
    # (the attention without parts is off by as much: 3.4e-5 here).
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 and q_scale > 1 else _tol(dtype)
    torch.testing.assert_close(together.double(), want, **tol)
    for b in range(len(lens)):
        alone = cpu.paged_attention_decode(q[b : b + 1], k_cache, v_cache, tables[b : b + 1], lens[b : b + 1], 0.125)
        assert torch.equal(alone, together[b : b + 1]), b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_is_attended_once_when_threads_claim_items_ahead(dtype, threads):
    """With two items or more per thread, a thread claims its next item before computing the
    current one (and requests its rows early): every row is still computed once, as alone,
    empty contexts between others included."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k_cache, v_cache, tables, lens = _paged_setup([33, 0, 18, 50, 0, 7, 90, 1, 0], 9, 3, 64, 16, dtype,
                                                         "nan_blocks")
        together = cpu.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125)
        for b in range(len(lens)):
            alone = cpu.paged_attention_decode(q[b : b + 1], k_cache, v_cache, tables[b : b + 1], lens[b : b + 1], 0.125)
            assert torch.equal(alone, together[b : b + 1]), b
        assert not together.isnan().any() and not together[lens == 0].any()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(9, 3), (4, 1)])
@pytest.mark.parametrize("block_size", [16, 4])
# 48: a part of fewer than 16 dimension pairs past the whole ones (K^T is transposed 16 pairs at a time)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_prompt_chunk_rows_attend_causally_each_up_to_itself(dtype, num_q_heads, num_kv_heads, block_size, head_dim):
    """A step's rows as the one-call step gives them: decode tokens, and prompt chunks whose
    tokens each carry their request's table and the context up to themselves. The kernel
    computes a chunk's tokens together (runs of equal tables and consecutive lengths, at
    most RUN_MAX_ROWS = 64 rows each: the 80-token chunk is two runs), in bf16 with AMX in
    tiles (from 16 query rows a run and KV head: amx_attend)."""
    setup = _paged_setup([70, 80, 120, 9], num_q_heads, num_kv_heads, head_dim, block_size, dtype, "nan_blocks")
    _, k_cache, v_cache, tables, _ = setup
    # rows: a decode of sequence 2; sequence 0's chunk of positions 60..69 (a cached prefix
    # before it); sequence 1's whole prompt of 80 as one chunk; a decode of sequence 3, whose
    # length follows the chunk's last by one: a run only where tables agree.
    rows = [(2, 120)] + [(0, n) for n in range(61, 71)] + [(1, n) for n in range(1, 81)] + [(3, 9)]
    row_tables = torch.stack([tables[seq] for seq, _ in rows])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    q = torch.randn(len(rows), num_q_heads, head_dim).to(dtype)
    out = cpu.paged_attention_decode(q, k_cache, v_cache, row_tables, lens, head_dim**-0.5)
    assert not out.isnan().any()
    want = _naive_decode_attention(q, k_cache, v_cache, row_tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out.double(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_softmax_survives_large_scores(dtype):
    """Scores far apart (exp underflows to 0 for all but the largest) stay finite and exact:
    a decode row, and a 20-token prompt chunk (in bf16 with AMX: in tiles)."""
    _, k_cache, v_cache, tables, _ = _paged_setup([20], 2, 1, 64, 8, dtype, "nan_blocks")
    lens = torch.arange(1, 21, dtype=torch.int32)
    q, tables = (torch.randn(20, 2, 64) * 200).to(dtype), tables.expand(20, -1)
    out = cpu.paged_attention_decode(q, k_cache, v_cache, tables, lens, 1.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), _naive_decode_attention(q, k_cache, v_cache, tables, lens, 1.0), **_tol(dtype))


def test_an_edit_to_any_source_file_builds_anew(tmp_path, monkeypatch):
    """The cache key hashes every file of csrc/, not the compiled file alone (it includes the
    others): a library built before an edit to any of them is never loaded after it."""
    sources = tmp_path / "csrc"
    shutil.copytree(cpu.SOURCE.parent, sources)
    monkeypatch.setattr(cpu, "SOURCE", sources / cpu.SOURCE.name)
    cc, flags = cpu._compiler(), cpu.compile_flags()
    keys = {cpu._library_path(cc, flags)}
    files = sorted(sources.iterdir())
    for path in files:
        path.write_text(path.read_text() + "\n")
        keys.add(cpu._library_path(cc, flags))
    assert len(keys) == len(files) + 1


def test_a_missing_compiler_falls_back_to_the_reference(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu, "CACHE_DIR", tmp_path / "cache")  # nothing cached to load
    cpu.reload()
    try:
        assert not cpu.available()
        assert "CPU kernels unavailable" in caplog.text
        x, w = torch.randn(3, 64), torch.randn(64)
        import kernels  # noqa: PLC0415 - the public op, now on its reference path

        assert torch.equal(kernels.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    finally:  # the compiler back, and the library with it: the next test's build may be this one
        monkeypatch.undo()
        cpu.reload()
