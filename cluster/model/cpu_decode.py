"""A decoder layer's decode step in five C calls (kernels/cpu.py), for CPU steps whose tokens
are all decodes, as many as the C linear takes.

The same math as DecoderLayer.forward, with every op whose output only feeds the next op
folded into that op:

    qkv     = linear(rms_norm(h))                    the norm applied as the linear reads its rows
    attn    = attend(rotary(q), store(rotary(k), v)) q rotated as it is loaded, k as it is stored
    h       = h + linear(attn)                       the residual added as the linear writes
    gate|up = linear(rms_norm(h))
    h       = h + linear(silu(gate) * up)

Each intermediate is rounded to the model's dtype where the per-op path rounds it, so both
paths give the same bits but for SiLU's exp (tests/unit/test_cpu_decode.py checks it).
Why: at decode batch sizes the ops are tiny, and on the per-op path each one's Python,
dispatch and ctypes cost (5-10 us) added up to about a third of a batch-1 step.
"""

from __future__ import annotations

import torch

from cluster.model.attention import AttentionMetadata
from kernels import cpu


def applies(model, h: torch.Tensor, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether this step's layers can take `decode_layer`: decode tokens only, few enough
    rows for the C linear, one tensor-parallel rank (the residual add sits inside o_proj and
    down_proj, before any all-reduce could), and everything in dtypes the kernels take."""
    if meta.num_decode_tokens != h.shape[0] or meta.prefills or model.group.is_parallel:
        return False
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return (all(linear.takes_c_kernel(h) for linear in linears) and all(w.dtype == h.dtype for w in norms)
            and cpu.usable(*kv_cache, attn.rotary.cos_sin_cache) and all(c.is_contiguous() for c in kv_cache))


def decode_layer(layer, h: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                 meta: AttentionMetadata) -> torch.Tensor:
    # h: [B, hidden] -> [B, hidden]; a DecoderLayer's forward for B decode tokens.
    attn, mlp, B = layer.self_attn, layer.mlp, h.shape[0]
    qkv = cpu.linear(h, attn.qkv_proj.c_kernel_weight(), attn.qkv_proj.bias,
                     norm=(layer.input_layernorm.weight, layer.input_layernorm.eps))
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(B, attn.num_heads, attn.head_dim)  # views into qkv's rows
    k = k.view(B, attn.num_kv_heads, attn.head_dim)
    v = v.view(B, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:  # Qwen3's per-head norms: two more calls
        q, k = attn.q_norm(q), attn.k_norm(k)
    out = cpu.rotary_store_attend(q, k, v, positions, attn.rotary.cos_sin_cache, meta.slot_mapping, *kv_cache,
                                  meta.decode_block_tables, meta.decode_context_lens, attn.scale)
    h = cpu.linear(out.view(B, attn.q_size), attn.o_proj.c_kernel_weight(), attn.o_proj.bias, residual=h)
    gate_up = cpu.linear(h, mlp.gate_up_proj.c_kernel_weight(), mlp.gate_up_proj.bias,
                         norm=(layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps))
    return cpu.linear(gate_up, mlp.down_proj.c_kernel_weight(), mlp.down_proj.bias, silu_mul=True, residual=h)
