"""The five hot ops: each Triton launcher (run on CPU under TRITON_INTERPRET=1, see conftest)
against its torch reference, and each reference against a naive / Hugging Face formula.

Tolerances: float32 compares at atol = rtol = 1e-5. bfloat16 compares at atol = rtol = 2e-2
(a bf16 ulp is 2^-8 ~ 4e-3 relative; the Triton kernels round once where torch rounds
after every op, and CPU SDPA rounds the softmax probabilities to bf16 before P @ V).
"""

import math

import pytest
import torch

import kernels
from kernels import cpu
from kernels.kv_store import store_kv_reference, store_kv_triton
from kernels.paged_attention import decode_gather, paged_attention_decode_reference, paged_attention_decode_triton
from kernels.rms_norm import rms_norm_reference, rms_norm_triton
from kernels.rotary import rotary_reference, rotary_triton
from kernels.silu_gate import silu_and_mul_reference, silu_and_mul_triton

DTYPES = [torch.float32, torch.bfloat16]
TOKEN_COUNTS = [1, 7, 33]


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- RMSNorm -------------------------------------------------------------------------------


def _hf_llama_rms_norm(hidden_states, weight, eps):
    # Copy of transformers' LlamaRMSNorm.forward.
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", ["same", torch.float32])
def test_rms_norm_reference_matches_hf(dtype, weight_dtype):
    x = (torch.randn(7, 96) * 3).to(dtype)
    weight = torch.randn(96).to(dtype if weight_dtype == "same" else weight_dtype)
    torch.testing.assert_close(rms_norm_reference(x, weight, 1e-6), _hf_llama_rms_norm(x, weight, 1e-6), rtol=0, atol=0)
    # Qwen3 q/k norm: per head on [T, H, D], weight [D].
    per_head = torch.randn(5, 3, 64).to(dtype)
    expected = torch.stack([_hf_llama_rms_norm(per_head[:, h], weight[:64], 1e-6) for h in range(3)], dim=1)
    torch.testing.assert_close(rms_norm_reference(per_head, weight[:64], 1e-6), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm_triton_matches_reference(num_tokens, hidden, dtype):
    x = (torch.randn(num_tokens, hidden) * 2 + 0.5).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    out = rms_norm_triton(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-5), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_triton_per_head_on_strided_view(dtype):
    # As Qwen3 q_norm sees it: q is a view into a fused qkv output, [T, Hq, D].
    qkv = torch.randn(7, 6 * 64).to(dtype)
    q = qkv[:, : 4 * 64].view(7, 4, 64)
    weight = torch.randn(64, dtype=torch.float32)  # fp32 weight: output promotes to fp32
    out = rms_norm_triton(q, weight, 1e-6)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_reference(q, weight, 1e-6), **_tol(dtype))


# --- Rotary --------------------------------------------------------------------------------


def _cos_sin_cache(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D]


def _hf_rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _hf_apply_rotary(q, k, positions, head_dim, theta=10000.0):
    # Copy of transformers' LlamaRotaryEmbedding.forward (default rope) + apply_rotary_pos_emb.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = (inv_freq[:, None] @ positions[None, :].float()).T  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # unsqueeze_dim=1 for [T, H, D]
    return (q * cos) + (_hf_rotate_half(q) * sin), (k * cos) + (_hf_rotate_half(k) * sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_reference_matches_hf(dtype, head_dim):
    q = torch.randn(9, 4, head_dim).to(dtype)
    k = torch.randn(9, 2, head_dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 500, 3, 4095, 17, 17, 1000])
    q_out, k_out = rotary_reference(q, k, positions, _cos_sin_cache(4096, head_dim))
    q_hf, k_hf = _hf_apply_rotary(q, k, positions, head_dim)
    torch.testing.assert_close(q_out, q_hf, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_hf, rtol=0, atol=0)
    assert not torch.equal(q_out, q)  # something was rotated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_q_heads, num_kv_heads, head_dim", [(1, 4, 4, 64), (7, 8, 2, 128), (33, 6, 1, 64)]
)
def test_rotary_triton_matches_reference(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype):
    # q/k are strided views into one fused qkv output, as the attention layer makes them.
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size).to(dtype)
    q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 2048, (num_tokens,))
    cache = _cos_sin_cache(2048, head_dim)
    qkv_before = qkv.clone()
    q_out, k_out = rotary_triton(q, k, positions, cache)
    q_ref, k_ref = rotary_reference(q, k, positions, cache)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.dtype == dtype
    torch.testing.assert_close(q_out, q_ref, **_tol(dtype))
    torch.testing.assert_close(k_out, k_ref, **_tol(dtype))
    assert torch.equal(qkv, qkv_before)  # inputs untouched


# --- SiLU gate -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("inter", [64, 200])
def test_silu_and_mul_triton_matches_reference(num_tokens, inter, dtype):
    x = (torch.randn(num_tokens, 2 * inter) * 3).to(dtype)
    out = silu_and_mul_triton(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_reference(x), **_tol(dtype))


def test_silu_and_mul_reference_is_gate_times_up():
    gate, up = torch.randn(5, 32), torch.randn(5, 32)
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_reference(torch.cat([gate, up], dim=-1)), expected)


# --- KV store ------------------------------------------------------------------------------


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype)
    return k_cache, k_cache.clone() - 14.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("block_size, num_kv_heads, head_dim", [(16, 4, 64), (8, 1, 128), (16, 3, 64)])
def test_store_kv_triton_matches_reference(num_tokens, block_size, num_kv_heads, head_dim, dtype):
    num_blocks = 8
    # key/value as strided views of a fused kv output; some tokens skipped (-1).
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim).to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[torch.rand(num_tokens) < 0.25] = -1
    k_ref, v_ref = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    store_kv_reference(key, value, k_ref, v_ref, slot_mapping)
    store_kv_triton(key, value, k_tri, v_tri, slot_mapping)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    # And the reference put each token where its slot says.
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(k_ref[slot // block_size, slot % block_size], key[t])
            assert torch.equal(v_ref[slot // block_size, slot % block_size], value[t])


@pytest.mark.parametrize("store", [store_kv_reference, store_kv_triton], ids=["reference", "triton"])
def test_store_kv_negative_slots_leave_cache_untouched(store):
    block_size, num_kv_heads, head_dim = 8, 2, 64
    k_cache, v_cache = _caches(4, block_size, num_kv_heads, head_dim, torch.float32)
    key, value = torch.randn(5, num_kv_heads, head_dim), torch.randn(5, num_kv_heads, head_dim)
    store(key, value, k_cache, v_cache, torch.full((5,), -1, dtype=torch.int64))
    assert (k_cache == 7.0).all() and (v_cache == -7.0).all()

    store(key, value, k_cache, v_cache, torch.tensor([-1, 9, -1, 0, 31]))
    written = {9: 1, 0: 3, 31: 4}
    for slot in range(4 * block_size):
        k_row, v_row = k_cache[slot // block_size, slot % block_size], v_cache[slot // block_size, slot % block_size]
        if slot in written:
            assert torch.equal(k_row, key[written[slot]]) and torch.equal(v_row, value[written[slot]])
        else:
            assert (k_row == 7.0).all() and (v_row == -7.0).all()


# --- Paged decode attention ----------------------------------------------------------------


def _paged_setup(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, padding):
    """A NaN-filled cache where only each sequence's live rows hold data, in shuffled blocks.

    padding: what fills block_tables past each sequence's blocks: "nan_blocks" (ids of
    NaN-only blocks, safe to dereference), or "sentinel" (-1 and out-of-range ids).
    """
    batch = len(context_lens)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + 4
    ids = torch.randperm(num_blocks)
    used, spare = ids[: sum(blocks_per_seq)], ids[sum(blocks_per_seq) :]
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    block_tables = torch.empty(batch, max_blocks, dtype=torch.int32)
    start = 0
    for b, (n, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        if padding == "nan_blocks":
            block_tables[b] = spare[torch.randint(0, len(spare), (max_blocks,))].int()
        else:
            block_tables[b] = torch.tensor([-1, 10**6])[torch.randint(0, 2, (max_blocks,))].int()
        block_tables[b, :nb] = used[start : start + nb].int()
        start += nb
        rows = torch.arange(n)
        blocks = block_tables[b, rows // block_size].long()
        k_cache[blocks, rows % block_size] = torch.randn(n, num_kv_heads, head_dim).to(dtype)
        v_cache[blocks, rows % block_size] = torch.randn(n, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(batch, num_q_heads, head_dim).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32)


def _naive_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Per sequence: softmax(q K^T * scale) V over its live tokens, dense, in float64."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(context_lens[b])
        ids = block_tables[b, : math.ceil(n / block_size)].long()
        k = k_cache[ids].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[ids].flatten(0, 1)[:n].double().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("nhd,hd->hn", k, q[b].double()) * scale, dim=-1)  # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2), (4, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("padding", ["nan_blocks", "sentinel"])
def test_paged_attention_reference_matches_naive(num_q_heads, num_kv_heads, head_dim, block_size, dtype, padding):
    context_lens = [1, 15, 17, 100, 257, 16]
    args = _paged_setup(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, padding)
    scale = head_dim**-0.5
    out = paged_attention_decode_reference(*args, scale)
    assert out.shape == args[0].shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), _naive_decode_attention(*args, scale), **_tol(dtype))
    # The runner's once-per-step gather plan gives the same result.
    gather = decode_gather(args[3], args[4], block_size)
    assert torch.equal(paged_attention_decode_reference(*args, scale, gather), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_reference_in_fp32_over_half_precision_kv(dtype):
    """The model's CPU decode path without AMX: an fp32 query over a bf16/fp16 cache."""
    q, *rest = _paged_setup([1, 15, 17, 100], 8, 2, 64, 16, dtype, "nan_blocks")
    out = paged_attention_decode_reference(q.float(), *rest, 0.125)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out.double(), _naive_decode_attention(q, *rest, 0.125), **_tol(torch.float32))


def test_paged_attention_reference_gathers_only_the_longest_context():
    # Table width 1000 blocks, of which only 2 are ever needed: the rest is never indexed.
    q, k_cache, v_cache, block_tables, context_lens = _paged_setup([3, 20], 4, 2, 64, 16, torch.float32, "nan_blocks")
    wide = torch.full((2, 1000), 10**9, dtype=torch.int32)
    wide[:, : block_tables.shape[1]] = block_tables
    out = paged_attention_decode_reference(q, k_cache, v_cache, wide, context_lens, 0.125)
    torch.testing.assert_close(out, paged_attention_decode_reference(q, k_cache, v_cache, block_tables, context_lens, 0.125))


# (context_lens, Hq, Hk, head_dim, block_size, dtype): every GQA ratio, both head dims and
# block sizes, both dtypes, and context lengths on both sides of block boundaries.
TRITON_ATTENTION_CASES = [
    ([1, 15, 17], 4, 4, 64, 16, torch.float32),
    ([100, 1], 4, 2, 128, 8, torch.float32),
    ([1, 15, 17, 100, 257], 4, 1, 64, 16, torch.float32),
    ([17, 33], 8, 2, 64, 32, torch.float32),
    ([15, 100], 8, 2, 64, 8, torch.bfloat16),
    ([1, 17], 4, 1, 128, 16, torch.bfloat16),
    ([16, 9], 4, 4, 128, 16, torch.bfloat16),
    ([257, 100], 8, 2, 128, 16, torch.bfloat16),
]


@pytest.mark.parametrize("context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype", TRITON_ATTENTION_CASES)
def test_paged_attention_triton_matches_reference(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    # NaN everywhere but the live rows, and NaN blocks as table padding: any stray read shows.
    args = _paged_setup(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, "nan_blocks")
    scale = head_dim**-0.5
    out = paged_attention_decode_triton(*args, scale)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_decode_reference(*args, scale), **_tol(dtype))
    torch.testing.assert_close(out.double(), _naive_decode_attention(*args, scale), **_tol(dtype))


@pytest.mark.parametrize(
    "attention", [paged_attention_decode_reference, paged_attention_decode_triton], ids=["reference", "triton"]
)
def test_paged_attention_empty_context_gives_zeros(attention):
    q, k_cache, v_cache, block_tables, _ = _paged_setup([5, 3], 4, 2, 64, 8, torch.float32, "nan_blocks")
    out = attention(q, k_cache, v_cache, block_tables, torch.tensor([5, 0], dtype=torch.int32), 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    expected = _naive_decode_attention(q[:1], k_cache, v_cache, block_tables[:1], torch.tensor([5]), 0.125)
    torch.testing.assert_close(out[:1].double(), expected, **_tol(torch.float32))


# --- Dispatch ------------------------------------------------------------------------------


@pytest.fixture
def reference_only(monkeypatch):
    """The C kernels switched off: the public ops fall back to torch's reference."""
    monkeypatch.setenv(cpu.SWITCH_ENV, "0")
    cpu.reload()
    yield
    monkeypatch.undo()
    cpu.reload()


def test_public_ops_use_the_reference_on_cpu_with_the_c_kernels_off(reference_only):
    assert sorted(kernels.__all__) == [
        "DecodeGather", "apply_rotary", "decode_gather", "paged_attention_decode", "rms_norm", "silu_and_mul", "store_kv"
    ]
    assert not cpu.available()
    assert cpu.describe() == "torch reference ops (PDSERVE_CPU_KERNELS=0)"
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    assert torch.equal(kernels.silu_and_mul(x), silu_and_mul_reference(x))
    q, k, positions, cache = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.tensor([0, 5, 2]), _cos_sin_cache(8, 64)
    for got, want in zip(kernels.apply_rotary(q, k, positions, cache), rotary_reference(q, k, positions, cache)):
        assert torch.equal(got, want)
    args = _paged_setup([5, 20], 4, 2, 64, 8, torch.float32, "nan_blocks")
    assert torch.equal(kernels.paged_attention_decode(*args, 0.125), paged_attention_decode_reference(*args, 0.125))
    k_cache, v_cache = _caches(4, 8, 2, 64, torch.float32)
    kernels.store_kv(k, 2 * k, k_cache, v_cache, torch.tensor([1, -1, 30]))
    assert torch.equal(k_cache[0, 1], k[0]) and torch.equal(v_cache[3, 6], 2 * k[2]) and (k_cache[0, 2] == 7.0).all()


def test_public_ops_take_the_c_kernels_on_cpu_where_they_build():
    """Where a C compiler exists (every supported machine: the README's set-up has one),
    the CPU path is the C kernel, checked against the reference in test_cpu_kernels.py."""
    assert cpu.available()
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), cpu.rms_norm(x, w, 1e-6))
    assert torch.equal(kernels.silu_and_mul(x), cpu.silu_and_mul(x))
    args = _paged_setup([5, 20], 4, 2, 64, 8, torch.float32, "nan_blocks")
    assert torch.equal(kernels.paged_attention_decode(*args, 0.125), cpu.paged_attention_decode(*args, 0.125))
