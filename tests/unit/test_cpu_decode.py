"""The fused CPU decode step (cluster/model/cpu_decode.py) against the per-op path it replaces:
first each fused C call against the ops it folds together, then whole decode steps of every
tiny family. On every build of tests/unit/test_cpu_kernels.py's ISA_BUILDS.

Exactness: the fused calls round every intermediate where the per-op path does, so they give
the same bits; only silu_mul differs, by SiLU's exp (within an ulp before rounding)."""

import dataclasses

import pytest
import torch

from cluster.model import cpu_decode
from cluster.model.attention import AttentionMetadata
from cluster.model.linear import C_KERNEL_MAX_ROWS
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
    torch.testing.assert_close(fused, cpu.linear(silu_and_mul_reference(x), packed, None), **_tol(dtype))


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


def _decode_step(model, kv_caches, context_lens: list[int], block_size: int):
    """A decode step of len(context_lens) sequences, each with its context (random K/V) in
    its own blocks: inputs for CausalLM.forward."""
    B, max_blocks = len(context_lens), max(-(-n // block_size) for n in context_lens)
    tables = torch.arange(B * max_blocks, dtype=torch.int32).view(B, max_blocks).flip(0).contiguous()
    positions = torch.tensor(context_lens) - 1
    slots = torch.stack([tables[b, p // block_size].long() * block_size + p % block_size for b, p in enumerate(positions.tolist())])
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=B, decode_block_tables=tables,
                             decode_context_lens=torch.tensor(context_lens, dtype=torch.int32), prefills=())
    input_ids = torch.randint(0, model.arch.vocab_size, (B,))
    return input_ids, positions, meta


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])  # GQA, MQA, qkv bias, q/k norms
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fused_decode_step_equals_the_per_op_step(tiny_models, family, dtype, monkeypatch):
    model = load_model(tiny_models[family], dtype=dtype).model
    arch, torch_dtype, block_size = model.arch, getattr(torch, dtype), 16
    shape = (12, block_size, model.shard.num_kv_heads, arch.head_dim)
    kv_caches = [(torch.randn(shape).to(torch_dtype), torch.randn(shape).to(torch_dtype)) for _ in range(arch.num_layers)]
    input_ids, positions, meta = _decode_step(model, kv_caches, [5, 40, 17], block_size)
    assert cpu_decode.applies(model, model.model.embed_tokens(input_ids), meta, kv_caches[0])

    per_op_caches = [(k.clone(), v.clone()) for k, v in kv_caches]
    fused = model(input_ids, positions, kv_caches, meta)
    monkeypatch.setattr(cpu_decode, "applies", lambda *args: False)
    per_op = model(input_ids, positions, per_op_caches, meta)
    torch.testing.assert_close(fused, per_op, **_tol(torch_dtype))
    for (k, v), (k_ref, v_ref) in zip(kv_caches, per_op_caches):  # the same rows written, the rest untouched
        torch.testing.assert_close(k, k_ref, **_tol(torch_dtype))
        torch.testing.assert_close(v, v_ref, **_tol(torch_dtype))


def test_steps_with_prefills_or_many_rows_keep_the_per_op_path(tiny_llama):
    model = load_model(tiny_llama, dtype="float32").model
    shape = (12, 16, model.shard.num_kv_heads, model.arch.head_dim)
    kv = (torch.zeros(shape), torch.zeros(shape))
    input_ids, _, meta = _decode_step(model, [kv], [5, 9], 16)
    h = model.model.embed_tokens(input_ids)
    assert cpu_decode.applies(model, h, meta, kv)
    assert not cpu_decode.applies(model, h, dataclasses.replace(meta, num_decode_tokens=1), kv)  # one row is a prefill's
    rows = C_KERNEL_MAX_ROWS + 1  # more than the C linear takes: oneDNN's linear, op by op
    assert not cpu_decode.applies(model, torch.zeros(rows, h.shape[1]), dataclasses.replace(meta, num_decode_tokens=rows), kv)
