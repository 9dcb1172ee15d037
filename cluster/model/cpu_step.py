"""A CPU step's decoder layers in one C call (kernels/cpu.py: step_layers), for steps of no
more rows than the C linear takes: decode tokens, prompt chunks' tokens (of little enough
context: `applies`), or both.

The same math as DecoderLayer.forward, with every op whose output only feeds the next op
folded into that op:

    qkv     = linear(rms_norm(h))                    the norm applied as the linear reads its rows
    attn    = attend(rotary(q), store(rotary(k), v)) q rotated as it is loaded, k as it is stored
    h       = h + linear(attn)                       the residual added as the linear writes
    gate|up = linear(rms_norm(h))
    h       = h + linear(silu(gate) * up)

Each intermediate is rounded to the model's dtype where the per-op path rounds it, so for
decode tokens both paths give the same bits but for SiLU's exp (tests/unit/test_cpu_step.py
checks it). A prompt chunk's token attends to its request's context up to itself: the C
attention gets each row's own context length and its request's block table, and computes
a chunk's tokens together (each cache block read once for all of them): in bf16 with AMX
in tiles, with AVX512-BF16 in dot products (P rounded to bf16 in both, as torch's SDPA rounds
it), elsewhere in exact fp32, so prompt
rows agree with the per-op path (the same C attention, or SDPA) within rounding.
Why: at these row counts the ops are tiny, and on the per-op path each one's Python,
dispatch and ctypes cost (5-10 us, ~15 ops a layer) added up to about a third of a
batch-1 step; a step with a prompt chunk beside its decodes paid it on top of torch's
per-sequence prefill attention (a mixed step of 8 decodes and 32 prompt tokens: 49 ms op by
op). The C side reads a table of each layer's tensors (`StepPlan`), built on the first
such step and again only when the kernels or the KV caches change.
"""

from __future__ import annotations

import torch

from cluster.model.attention import AttentionMetadata, prompt_attention_in_c
from kernels import cpu

KVCache = tuple[torch.Tensor, torch.Tensor]


# Where the C attention computes in fp32 FMAs (attention.prompt_attention_in_c is false: fp32,
# or bf16 without AVX512-BF16), a prompt chunk's rows attend here at about SDPA's cost per
# (row, context token) for short contexts and more for long ones (fp32 capped at AVX2, 2
# threads, a layer: 32 tokens after 224 0.33 vs 0.31 ms, after 1024 1.27 vs 1.06 ms, 256 after
# 1024 8.3 vs 6.3 ms); past this many pairs in a step the per-op path is cheaper. Where it
# multiplies bf16 in hardware, the C attention is the cheaper at any context.
MAX_PROMPT_ATTENTION_PAIRS = 16 * 1024


def applies(model, h: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> bool:
    """Whether this step's layers can take `step_layers`: few enough rows for the C linear,
    prompt chunks with little enough context, one tensor-parallel rank (the residual add
    sits inside o_proj and down_proj, before any all-reduce could), and everything in
    dtypes the kernels take, one weight dtype (or quantized format) in every layer's linears."""
    if model.group.is_parallel:
        return False
    if (sum(seq.query_len * seq.context_len for seq in meta.prefills) > MAX_PROMPT_ATTENTION_PAIRS
            and not prompt_attention_in_c(h, kv_cache[0])):
        return False
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if attn.q_norm else [])
    return (all(linear.takes_c_kernel(h) for linear in linears)
            and model.uniform_linear_weights
            and all(linear.bias is None for linear in linears[1:])  # only qkv has a bias in any family
            and all(norm.weight.dtype == h.dtype for norm in norms)
            and cpu.usable(*kv_cache, attn.rotary.cos_sin_cache) and all(c.is_contiguous() for c in kv_cache))


def row_attention(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's block table [T, max blocks] and context length [T]: a decode token's as
    the step has them; a prompt chunk's token gets its request's table and the context up
    to and including itself."""
    if not meta.prefills:
        return meta.decode_block_tables, meta.decode_context_lens
    D, decode_tables = meta.num_decode_tokens, meta.decode_block_tables
    rows = D + sum(seq.query_len for seq in meta.prefills)
    width = max([decode_tables.shape[1] if D else 0] + [len(seq.block_ids) for seq in meta.prefills])
    tables = torch.zeros(rows, width, dtype=torch.int32)
    lens = torch.empty(rows, dtype=torch.int32)
    if D:
        tables[:D, : decode_tables.shape[1]] = decode_tables
        lens[:D] = meta.decode_context_lens
    for seq in meta.prefills:
        chunk = slice(seq.query_start, seq.query_start + seq.query_len)
        tables[chunk, : len(seq.block_ids)] = seq.block_ids.to(torch.int32)
        first = seq.context_len - seq.query_len + 1
        lens[chunk] = torch.arange(first, seq.context_len + 1, dtype=torch.int32)
    return tables, lens


class StepPlan:
    """The C table of a model's layers (packed weights, norm weights, KV caches) and the shape
    they share. Valid while the loaded kernels and the KV cache list stay the ones it was
    built for; pointers into tensors that the model and the engine own."""

    def __init__(self, model, kv_caches: list[KVCache], dtype: torch.dtype):
        arch, layers = model.arch, model.model.layers
        attn0 = layers[0].self_attn
        self.library, self.kv_caches, self.dtype = cpu.library(), kv_caches, dtype
        self.shape = cpu.DecoderShape(arch.hidden_size, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
                                      layers[0].mlp.down_proj.in_features, arch.rms_norm_eps, attn0.scale)
        self.table = (cpu.StepLayer * len(layers))()
        self.weight_code = attn0.qkv_proj.c_kernel_weight().code  # every layer's (CausalLM.uniform_linear_weights)
        for entry, layer, (k_cache, v_cache) in zip(self.table, layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            entry.input_norm, entry.post_norm = _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight)
            entry.qkv, entry.qkv_bias = attn.qkv_proj.c_kernel_weight().data.data_ptr(), _ptr(attn.qkv_proj.bias)
            entry.q_norm, entry.k_norm = (_ptr(attn.q_norm.weight), _ptr(attn.k_norm.weight)) if attn.q_norm else (None, None)
            entry.o_proj = attn.o_proj.c_kernel_weight().data.data_ptr()
            entry.gate_up = mlp.gate_up_proj.c_kernel_weight().data.data_ptr()
            entry.down = mlp.down_proj.c_kernel_weight().data.data_ptr()
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()

    def fits(self, kv_caches: list[KVCache], dtype: torch.dtype) -> bool:
        return self.library is cpu.library() and self.kv_caches is kv_caches and self.dtype == dtype


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def step_layers(model, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
    # h: [T, hidden], this step's own tensor (the embedding's output) -> the same tensor, updated in place
    plan: StepPlan | None = model.cpu_step_plan
    if plan is None or not plan.fits(kv_caches, h.dtype):
        plan = model.cpu_step_plan = StepPlan(model, kv_caches, h.dtype)
    k_cache = kv_caches[0][0]
    tables, lens = row_attention(meta)
    return cpu.step_layers(h, plan.table, plan.weight_code, plan.shape, positions, model.model.layers[0].self_attn.rotary.cos_sin_cache,
                           meta.slot_mapping, tables, lens, k_cache.dtype, k_cache.shape[1])
