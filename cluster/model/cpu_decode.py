"""A CPU decode step's decoder layers in one C call (kernels/cpu.py: decode_layers), for steps
whose tokens are all decodes, as many as the C linear takes.

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
dispatch and ctypes cost (5-10 us, ~15 ops a layer) added up to about a third of a
batch-1 step. The C side reads a table of each layer's tensors (`DecodePlan`), built on
the first such step and again only when the kernels or the KV caches change.
"""

from __future__ import annotations

import torch

from cluster.model.attention import AttentionMetadata
from kernels import cpu

KVCache = tuple[torch.Tensor, torch.Tensor]


def applies(model, h: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> bool:
    """Whether this step's layers can take `decode_layers`: decode tokens only, few enough
    rows for the C linear, one tensor-parallel rank (the residual add sits inside o_proj and
    down_proj, before any all-reduce could), and everything in dtypes the kernels take."""
    if meta.num_decode_tokens != h.shape[0] or meta.prefills or model.group.is_parallel:
        return False
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([attn.q_norm, attn.k_norm] if attn.q_norm else [])
    return (all(linear.takes_c_kernel(h) for linear in linears)
            and all(linear.bias is None for linear in linears[1:])  # only qkv has a bias in any family
            and all(norm.weight.dtype == h.dtype for norm in norms)
            and cpu.usable(*kv_cache, attn.rotary.cos_sin_cache) and all(c.is_contiguous() for c in kv_cache))


class DecodePlan:
    """The C table of a model's layers (packed weights, norm weights, KV caches) and the shape
    they share. Valid while the loaded kernels and the KV cache list stay the ones it was
    built for; pointers into tensors that the model and the engine own."""

    def __init__(self, model, kv_caches: list[KVCache], dtype: torch.dtype):
        arch, layers = model.arch, model.model.layers
        attn0 = layers[0].self_attn
        self.library, self.kv_caches, self.dtype = cpu.library(), kv_caches, dtype
        self.shape = cpu.DecoderShape(arch.hidden_size, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
                                      layers[0].mlp.down_proj.in_features, arch.rms_norm_eps, attn0.scale)
        self.table = (cpu.DecodeLayer * len(layers))()
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


def decode_layers(model, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                  meta: AttentionMetadata) -> torch.Tensor:
    # h: [B, hidden], this step's own tensor (the embedding's output) -> the same tensor, updated in place
    plan: DecodePlan | None = model.cpu_decode_plan
    if plan is None or not plan.fits(kv_caches, h.dtype):
        plan = model.cpu_decode_plan = DecodePlan(model, kv_caches, h.dtype)
    k_cache = kv_caches[0][0]
    return cpu.decode_layers(h, plan.table, plan.shape, positions, model.model.layers[0].self_attn.rotary.cos_sin_cache,
                             meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, k_cache.dtype,
                             k_cache.shape[1])
