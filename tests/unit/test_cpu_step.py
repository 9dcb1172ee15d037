"""The one-call CPU step (cluster/model/cpu_step.py) against the per-op path it replaces:
first each fused C call against the ops it folds together, then whole steps of every tiny
family, decode-only and mixed (prompt chunks beside decodes). On every build of
tests/unit/test_cpu_kernels.py's ISA_BUILDS.

Exactness: the fused calls round every intermediate where the per-op path does, so they give
the same bits; only silu_mul differs, by SiLU's exp (within an ulp before rounding), and a
prompt chunk's attention (exact fp32 here, or AMX tiles with P in bf16; torch's SDPA or the
same C attention on the per-op path)."""


import pytest
import torch

from cluster.host.cpu_features import detect
from cluster.model import attention, cpu_step
from cluster.model.attention import AttentionMetadata, PrefillSeq
from cluster.model.linear import WIDE_KERNEL_MAX_ROWS, c_kernel_max_rows
from cluster.model.loader import load_model
from kernels import cpu
from kernels.silu_gate import silu_and_mul_reference
from tests.unit.test_cpu_kernels import DTYPES, _seed, isa  # noqa: F401 - its autouse fixtures: a seed, every ISA build
from tests.unit.test_kernels import _cos_sin_cache, _paged_setup, _tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 64, 96), (5, 33, 40), (16, 576, 200)])
def test_the_norm_prologue_is_rms_norm_then_linear(dtype, rows, in_features, out_features):
    x = torch.randn(rows, in_features).to(dtype)
    w, norm_w = torch.randn(out_features, in_features).to(dtype), torch.rand(in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    packed = cpu.pack_linear_weight(w)
    fused = cpu.linear(x, packed, bias, norm=(norm_w, 1e-5))
    assert torch.equal(fused, cpu.linear(cpu.rms_norm(x, norm_w, 1e-5), packed, bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, in_features, out_features", [(1, 64, 96), (5, 33, 40), (9, 1536, 576)])
def test_the_residual_epilogue_adds_the_rounded_output(dtype, rows, in_features, out_features):
    x, residual = torch.randn(rows, in_features).to(dtype), torch.randn(rows, out_features).to(dtype)
    packed = cpu.pack_linear_weight(torch.randn(out_features, in_features).to(dtype))
    fused = cpu.linear(x, packed, None, residual=residual)
    assert torch.equal(fused, residual + cpu.linear(x, packed, None))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 64), (7, 33), (16, 1536)])
def test_the_silu_mul_prologue_is_silu_and_mul_then_linear(dtype, rows, inter):
    # gate values over SiLU's whole range: large negative (exp underflows), around 0, large positive
    x = (torch.randn(rows, 2 * inter) * 6).to(dtype)
    x[0, :3] = torch.tensor([-100.0, 0.0, 100.0]).to(dtype)
    packed = cpu.pack_linear_weight(torch.randn(24, inter).to(dtype))
    fused = cpu.linear(x, packed, None, silu_mul=True)
    # The same bits as the C SiLU-and-mul (tested against torch's in test_cpu_kernels.py)
    # then the linear. Against torch's SiLU here, its ulps summed over 1536 products
    # exceeded fp32's tolerance for some seeds on every build.
    assert torch.equal(fused, cpu.linear(cpu.silu_and_mul(x), packed, None))
    torch.testing.assert_close(cpu.silu_and_mul(x), silu_and_mul_reference(x), **_tol(dtype))


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (4, 1, 64)])
def test_rotary_store_attend_is_the_three_ops_in_turn(q_dtype, cache_dtype, num_q_heads, num_kv_heads, head_dim):
    block_size, lens = 16, [1, 17, 40, 33]
    # the cache holds each sequence's context but for its newest token, written by the call
    setup = _paged_setup(lens, num_q_heads, num_kv_heads, head_dim, block_size, cache_dtype, "nan_blocks")
    _, k_cache, v_cache, tables, context_lens = setup
    B = len(lens)
    qkv = torch.randn(B, (num_q_heads + 2 * num_kv_heads) * head_dim).to(q_dtype)  # q, k, v: views of one row
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(B, num_q_heads, head_dim), k.view(B, num_kv_heads, head_dim), v.view(B, num_kv_heads, head_dim)
    positions = context_lens.long() - 1
    slots = torch.stack([tables[b, p // block_size].long() * block_size + p % block_size for b, p in enumerate(positions.tolist())])
    cos_sin = _cos_sin_cache(64, head_dim)

    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = cpu.rotary(q, k, positions, cos_sin)
    cpu.store_kv(k_rot, v, want_k, want_v, slots)
    want = cpu.paged_attention_decode(q_rot, want_k, want_v, tables, context_lens, head_dim**-0.5)

    got = cpu.rotary_store_attend(q, k, v, positions, cos_sin, slots, k_cache, v_cache, tables, context_lens, head_dim**-0.5)
    assert torch.equal(k_cache.nan_to_num(), want_k.nan_to_num()) and torch.equal(v_cache.nan_to_num(), want_v.nan_to_num())
    assert torch.equal(got, want)


def _load(path, dtype: str):
    """The model on the ISA build under test (the `isa` fixture's): loading configures the
    kernels for this CPU's capabilities (PDSERVE_CPU_DISABLE), so the build is put back
    after it (the weights are packed again for it at the first step)."""
    build = cpu.isa_flags()
    model = load_model(path, dtype=dtype).model
    cpu.configure(build)
    return model


def _mixed_step(model, decode_lens: list[int], chunks: list[tuple[int, int]], block_size: int):
    """A step of decodes (each with its context of len-1 cached tokens) and prompt chunks
    ((cached tokens, new tokens) each), every sequence in its own blocks: inputs for
    CausalLM.forward. Decodes come first, as the runner lays a step out."""
    seqs = [(n - 1, 1) for n in decode_lens] + chunks
    widths = [-(-(c + n) // block_size) for c, n in seqs]
    ids = torch.randperm(sum(widths)).split(widths)  # blocks in shuffled order
    positions, slots, prefills = [], [], []
    for (cached, n), blocks in zip(seqs, ids):
        pos = list(range(cached, cached + n))
        if n > 1:
            prefills.append(PrefillSeq(query_start=len(positions), query_len=n, context_len=cached + n, block_ids=blocks.long()))
        positions += pos
        slots += [int(blocks[p // block_size]) * block_size + p % block_size for p in pos]
    D, max_blocks = len(decode_lens), max(widths)
    tables = torch.zeros(D, max_blocks, dtype=torch.int32)
    for b in range(D):
        tables[b, : widths[b]] = ids[b]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=D, decode_block_tables=tables,
                             decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32), prefills=tuple(prefills))
    input_ids = torch.randint(0, model.arch.vocab_size, (len(positions),))
    return input_ids, torch.tensor(positions), meta, sum(widths)


def _fused_and_per_op(model, step, cache_dtype, monkeypatch):
    """The step run both ways on copies of one random cache: (fused output, per-op output,
    fused caches, per-op caches)."""
    input_ids, positions, meta, num_blocks = step
    arch = model.arch
    shape = (num_blocks, 16, model.shard.num_kv_heads, arch.head_dim)
    kv_caches = [(torch.randn(shape).to(cache_dtype), torch.randn(shape).to(cache_dtype)) for _ in range(arch.num_layers)]
    assert cpu_step.applies(model, model.model.embed_tokens(input_ids), meta, kv_caches[0])
    per_op_caches = [(k.clone(), v.clone()) for k, v in kv_caches]
    fused = model(input_ids, positions, kv_caches, meta)
    monkeypatch.setattr(cpu_step, "applies", lambda *args: False)
    per_op = model(input_ids, positions, per_op_caches, meta)
    return fused, per_op, kv_caches, per_op_caches


# (model dtype, KV cache dtype): the model's own, and a bf16 cache under a float32 model
DTYPE_PAIRS = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])  # GQA, MQA, qkv bias, q/k norms
@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
def test_a_fused_decode_step_equals_the_per_op_step(tiny_models, family, dtype, cache_dtype, monkeypatch):
    model = _load(tiny_models[family], dtype)
    torch_dtype, torch_cache_dtype = getattr(torch, dtype), getattr(torch, cache_dtype)
    step = _mixed_step(model, [5, 40, 17], [], 16)
    fused, per_op, kv_caches, per_op_caches = _fused_and_per_op(model, step, torch_cache_dtype, monkeypatch)
    torch.testing.assert_close(fused, per_op, **_tol(torch_dtype))
    for (k, v), (k_ref, v_ref) in zip(kv_caches, per_op_caches):  # the same rows written, the rest untouched
        torch.testing.assert_close(k, k_ref, **_tol(torch_cache_dtype))
        torch.testing.assert_close(v, v_ref, **_tol(torch_cache_dtype))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype, cache_dtype", DTYPE_PAIRS)
def test_a_fused_mixed_step_equals_the_per_op_step(tiny_models, family, dtype, cache_dtype, monkeypatch):
    """Decodes beside a prompt chunk after a cached prefix and a whole short prompt: the
    chunks' tokens attend causally, each up to itself, in the one call too."""
    model = _load(tiny_models[family], dtype)
    torch_dtype = getattr(torch, dtype)
    rows = min(c_kernel_max_rows(torch_dtype), WIDE_KERNEL_MAX_ROWS)  # bf16 without native bf16: no limit
    chunks = [(21, rows // 2 - 3), (0, rows // 2 - 2)]  # with the 3 decodes below: one row short of the limit
    step = _mixed_step(model, [5, 40, 17], chunks, 16)
    fused, per_op, kv_caches, per_op_caches = _fused_and_per_op(model, step, getattr(torch, cache_dtype), monkeypatch)
    # The prompt rows' attention is exact fp32 here and torch's bf16 SDPA op by op: in bf16
    # the hidden states (magnitude ~2) may differ by a couple of bf16 ulps (0.016 each). With
    # a bf16 cache under fp32, both paths attend to the same rounded K/V rows in fp32.
    tol = _tol(torch_dtype) if torch_dtype == torch.float32 else {"atol": 0.04, "rtol": 0.02}
    cache_tol = tol if cache_dtype == dtype else _tol(torch.bfloat16)
    torch.testing.assert_close(fused, per_op, **tol)
    for (k, v), (k_ref, v_ref) in zip(kv_caches, per_op_caches):
        torch.testing.assert_close(k, k_ref, **cache_tol)
        torch.testing.assert_close(v, v_ref, **cache_tol)


def test_steps_of_many_rows_or_tensor_parallel_keep_the_per_op_path(tiny_llama):
    model = load_model(tiny_llama, dtype="float32").model
    shape = (12, 16, model.shard.num_kv_heads, model.arch.head_dim)
    kv = (torch.zeros(shape), torch.zeros(shape))
    input_ids, _, meta, _ = _mixed_step(model, [5, 9], [(0, 6)], 16)
    h = model.model.embed_tokens(input_ids)
    assert cpu_step.applies(model, h, meta, kv)  # decodes and a prompt chunk: one call
    rows = c_kernel_max_rows(torch.float32) + 1  # more than the C linear takes: oneDNN's linear, op by op
    assert not cpu_step.applies(model, torch.zeros(rows, h.shape[1]), meta, kv)
    # a prompt chunk deep into a long prompt: its attention is cheaper op by op (SDPA)
    def chunk_at(context_len):
        seq = PrefillSeq(query_start=0, query_len=16, context_len=context_len, block_ids=torch.arange(context_len // 16))
        return AttentionMetadata(meta.slot_mapping, 0, meta.decode_block_tables[:0], meta.decode_context_lens[:0], (seq,))
    h16 = torch.zeros(16, h.shape[1])
    assert cpu_step.applies(model, h16, chunk_at(16 * 64), kv)
    assert not cpu_step.applies(model, h16, chunk_at(16 * 65), kv)  # 16 x 1040 > MAX_PROMPT_ATTENTION_PAIRS


def test_a_deep_prompt_chunk_stays_in_one_call_where_attention_multiplies_bf16(tiny_llama):
    """Past MAX_PROMPT_ATTENTION_PAIRS the one call is kept only where its prompt attention
    multiplies bf16 in hardware (AMX tiles or AVX512-BF16 dot products: cheaper than SDPA
    there); the fp32 FMAs of the other builds are not."""
    model = _load(tiny_llama, "bfloat16")
    shape = (70, 16, model.shard.num_kv_heads, model.arch.head_dim)
    kv = (torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
    seq = PrefillSeq(query_start=0, query_len=16, context_len=16 * 65, block_ids=torch.arange(65))
    meta = AttentionMetadata(torch.arange(16), 0, torch.zeros(0, 65, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), (seq,))
    h16 = torch.zeros(16, model.arch.hidden_size, dtype=torch.bfloat16)
    # the AVX2, SSE or no-bf16 build
    capped_below_bf16 = bool({"-mno-avx512f", "-mno-avx", "-mno-avx512bf16"} & set(cpu.isa_flags()))
    assert cpu.bf16_products() == (detect().native_bf16 and not capped_below_bf16)  # the build under test's
    assert cpu_step.applies(model, h16, meta, kv) == cpu.bf16_products()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_per_op_prompt_attention_in_c_equals_sdpa(tiny_models, family, monkeypatch):
    """Op by op, prompt chunks attend in the C kernel where it multiplies bf16 in hardware
    (attention.prompt_attention_in_c), in torch's SDPA elsewhere: the same step both ways
    agrees within bf16 rounding (P is rounded to bf16 in both)."""
    model = _load(tiny_models[family], "bfloat16")
    # chunks after cached context, and a whole prompt (no context: SDPA's causal kernel elsewhere)
    input_ids, positions, meta, num_blocks = _mixed_step(model, [5, 40], [(37, 30), (80, 20), (0, 24)], 16)
    shape = (num_blocks, 16, model.shard.num_kv_heads, model.arch.head_dim)
    kv_caches = [(torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16)) for _ in range(model.arch.num_layers)]
    monkeypatch.setattr(cpu_step, "applies", lambda *args: False)
    got = model(input_ids, positions, [(k.clone(), v.clone()) for k, v in kv_caches], meta)
    monkeypatch.setattr(attention, "prompt_attention_in_c", lambda *args: False)
    want = model(input_ids, positions, kv_caches, meta)
    torch.testing.assert_close(got, want, atol=0.04, rtol=0.02)
